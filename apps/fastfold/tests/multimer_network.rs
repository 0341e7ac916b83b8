//! Pieces of AlphaFold-Multimer's network against DeepMind's code on the same random
//! parameters and inputs (`fixtures/multimer_network/make_multimer_network.py`: a complex of
//! four copies of one chain and one chain of another entity, fp32 on CPU): the MSA features,
//! the input embedding with the relative encoding over chains, one Evoformer block with the
//! outer product mean first (with the monomer's triangle projections and with v3's fused
//! ones), the template pair stack's input and v3's whole template embedding, the templates'
//! chi angles and MSA rows, pTM, ipTM and the ranking confidence, and the structure module
//! (its invariant point attention on random frames, every fold iteration's frames and
//! torsions, the final atoms).
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use engine::parallel::dap::Dap;
use fastfold::confidence::{multimer_ranking_confidence, predicted_tm_score_of_chains};
use fastfold::geometry::Rigid;
use fastfold::model::exec::Stage;
use fastfold::model::layers::Stream;
use fastfold::model::multimer::{
    chi_angles, extra_msa_feat, load_structure_module, msa_feat, relative_encoding, ChainIds, MultimerInputEmbedder,
    MultimerTemplateRows, MultimerTemplates, TemplateAtoms, TemplateBatch, TemplatePairEmbedding,
};
use fastfold::model::pair_rows::PairRows;
use fastfold::model::{EvoformerStack, Exec, Params};
use tch::{Kind, Tensor};

/// Largest allowed difference from AlphaFold, relative to the compared array's largest
/// magnitude (at least 1): both sides compute in fp32, in different summation orders.
const TOLERANCE: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network").join(name)
}

fn arrays(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture(name)).unwrap().into_iter().collect()
}

fn chain_ids(f: &HashMap<String, Tensor>) -> ChainIds<'_> {
    ChainIds {
        residue_index: &f["residue_index"],
        asym_id: &f["asym_id"],
        entity_id: &f["entity_id"],
        sym_id: &f["sym_id"],
    }
}

#[test]
fn relative_encoding_equals_alphafold_multimer() {
    let f = arrays("input_embedding.npz");
    let got = relative_encoding(&chain_ids(&f), Kind::Float).unwrap();
    // One-hots and a flag: exactly equal.
    common::assert_close("rel_feat", &got, &f["rel_feat"], 0.0);
}

#[test]
fn input_embedding_equals_alphafold_multimer() {
    let f = arrays("input_embedding.npz");
    let embedder = MultimerInputEmbedder::load(fixture("input_embedding_params.npz")).unwrap();
    for chunk in [None, Some(5)] {
        let exec = Exec::new(Dap::none(), chunk);
        let (msa, pair) = tch::no_grad(|| embedder.embed(&f["aatype"], &f["msa_feat"], &chain_ids(&f), &exec).unwrap());
        common::assert_close(&format!("msa (chunk {chunk:?})"), &msa, &f["msa"], TOLERANCE);
        common::assert_close(&format!("pair (chunk {chunk:?})"), &pair, &f["pair"], TOLERANCE);
    }
}

#[test]
fn msa_features_equal_alphafold_multimer() {
    let f = arrays("input_embedding.npz");
    let got =
        msa_feat(&f["msa_classes"], &f["deletion_matrix"], &f["cluster_profile"], &f["cluster_deletion_mean"]).unwrap();
    common::assert_close("msa_feat", &got, &f["msa_feat"], TOLERANCE);
    let x = arrays("extra_msa_feat.npz");
    let got = extra_msa_feat(&x["extra_msa"], &x["extra_deletion_matrix"]).unwrap();
    common::assert_close("extra msa feature", &got, &x["extra_msa_feat"], TOLERANCE);
    let e = msa_feat(
        &f["msa_classes"],
        &f["deletion_matrix"],
        &f["cluster_profile"].narrow(2, 0, 22),
        &f["cluster_deletion_mean"],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cluster_profile") && e.contains("23"), "{e}");
}

#[test]
fn evoformer_block_with_outer_product_mean_first_equals_alphafold_multimer() {
    let f = arrays("evoformer_block.npz");
    let params = Params::load_npz(fixture("evoformer_block_params.npz")).unwrap();
    assert!(!params.config().outer_product_mean_first, "a file of the stacks alone cannot tell the order");
    let params = params.with_outer_product_mean_first(true);
    let stack = EvoformerStack::main(&params).unwrap();
    assert_eq!(stack.len(), 1);
    for chunk in [None, Some(3)] {
        let exec = Exec::new(Dap::none(), chunk);
        let (msa, pair, _) = tch::no_grad(|| {
            stack.forward(kept(&f["msa"]), kept(&f["pair"]), &f["msa_mask"], &f["pair_mask"], &exec, None).unwrap()
        });
        common::assert_close(&format!("msa (chunk {chunk:?})"), &msa, &f["msa_out"], TOLERANCE);
        common::assert_close(&format!("pair (chunk {chunk:?})"), &pair, &f["pair_out"], TOLERANCE);
    }
    // The monomer's order on the same arrays gives another pair: the flag is what matched.
    let monomer = EvoformerStack::main(&params.with_outer_product_mean_first(false)).unwrap();
    let (_, pair, _) = tch::no_grad(|| {
        monomer
            .forward(kept(&f["msa"]), kept(&f["pair"]), &f["msa_mask"], &f["pair_mask"], &Exec::serial(), None)
            .unwrap()
    });
    let d = (&pair - &f["pair_out"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "the monomer block order differs from the multimer's by only {d:e}");
}

#[test]
fn evoformer_block_with_fused_triangle_projections_equals_alphafold_multimer_v3() {
    let f = arrays("evoformer_block_v3.npz");
    let params = Params::load_npz(fixture("evoformer_block_v3_params.npz")).unwrap();
    assert!(params.config().fused_triangle_projections, "v3's fused arrays are read from the file");
    let stack = EvoformerStack::main(&params.with_outer_product_mean_first(true)).unwrap();
    for chunk in [None, Some(3)] {
        let exec = Exec::new(Dap::none(), chunk);
        let (msa, pair, _) = tch::no_grad(|| {
            stack.forward(kept(&f["msa"]), kept(&f["pair"]), &f["msa_mask"], &f["pair_mask"], &exec, None).unwrap()
        });
        common::assert_close(&format!("v3 msa (chunk {chunk:?})"), &msa, &f["msa_out"], TOLERANCE);
        common::assert_close(&format!("v3 pair (chunk {chunk:?})"), &pair, &f["pair_out"], TOLERANCE);
    }
}

#[test]
fn template_pair_embedding_equals_alphafold_multimer() {
    let f = arrays("template_pair_embedding.npz");
    let embedding = TemplatePairEmbedding::load(fixture("template_pair_embedding_params.npz")).unwrap();
    let atoms = TemplateAtoms {
        aatype: &f["template_aatype"],
        positions: &f["template_all_atom_positions"],
        mask: &f["template_all_atom_mask"],
    };
    let act = tch::no_grad(|| embedding.forward(&f["query"], &atoms, &f["asym_id"]).unwrap());
    common::assert_close("template stack input", &act, &f["act"], TOLERANCE);
    // Made 5 rows at a time (each chunk's features only): the same.
    let exec = Exec::new(Dap::none(), Some(5)).in_stage(Stage::Templates);
    let chunked = tch::no_grad(|| embedding.embed(&f["query"], &atoms, &f["asym_id"], &exec).unwrap());
    common::assert_close("template stack input in chunks of 5 rows", &chunked, &f["act"], TOLERANCE);
    // Between chains every template feature but the residue types is zero: only the query
    // and the one-hots' layers differ from a template of no atoms there.
    let empty_mask = f["template_all_atom_mask"].zeros_like();
    let empty = TemplateAtoms { mask: &empty_mask, ..atoms };
    let none = tch::no_grad(|| embedding.forward(&f["query"], &empty, &f["asym_id"]).unwrap());
    let (a, b) = (act.get(0).get(15), none.get(0).get(15));
    assert!(a.allclose(&b, 1e-6, 1e-6, false), "residues 0 and 15 are in different chains");
}

#[test]
fn template_embedding_equals_alphafold_multimer_v3() {
    let f = arrays("template_embedding.npz");
    let templates = MultimerTemplates::load(fixture("template_embedding_params.npz")).unwrap();
    let batch = TemplateBatch {
        aatype: &f["template_aatype"],
        positions: &f["template_all_atom_positions"],
        mask: &f["template_all_atom_mask"],
    };
    for chunk in [None, Some(4)] {
        let exec = Exec::new(Dap::none(), chunk);
        let out = tch::no_grad(|| {
            let averaged = templates.average(&f["query"], &batch, &f["pair_mask"], &f["asym_id"], &exec, None);
            templates.project(&averaged.unwrap()).unwrap()
        });
        common::assert_close(&format!("template embedding (chunk {chunk:?})"), &out, &f["output"], TOLERANCE);
        // Added to the pair in place (the sum, mean and ReLU in one buffer, the projection
        // rows at a time): the same update.
        let added = tch::no_grad(|| {
            let mut pair = Stream::new(f["query"].copy(), true);
            let rows = PairRows::whole(f["query"].size()[0]);
            templates.add_update(&mut pair, &batch, &f["pair_mask"], &f["asym_id"], &exec, None, &rows).unwrap();
            pair.into_inner() - &f["query"]
        });
        let what = format!("template update added in place (chunk {chunk:?})");
        common::assert_close(&what, &added, &f["output"], TOLERANCE);
    }
}

#[test]
fn template_chi_angles_and_rows_equal_alphafold_multimer() {
    let f = arrays("template_rows.npz");
    let (angles, mask) =
        chi_angles(&f["template_aatype"], &f["template_all_atom_positions"], &f["template_all_atom_mask"]).unwrap();
    common::assert_close("chi mask", &mask, &f["chi_mask"], 0.0);
    // Angles where they are defined (elsewhere they enter the rows times 0).
    common::assert_close("chi angles", &(&angles * &mask), &(&f["chi_angles"] * &mask), TOLERANCE);
    let rows = MultimerTemplateRows::load(fixture("template_rows_params.npz")).unwrap();
    let batch = TemplateBatch {
        aatype: &f["template_aatype"],
        positions: &f["template_all_atom_positions"],
        mask: &f["template_all_atom_mask"],
    };
    let (got, got_mask) = tch::no_grad(|| rows.forward(&batch, Kind::Float).unwrap());
    common::assert_close("template rows", &got, &f["rows"], TOLERANCE);
    common::assert_close("template row mask", &got_mask, &f["row_mask"], 0.0);
}

#[test]
fn iptm_ptm_and_ranking_equal_alphafold_confidence() {
    let f = arrays("confidence.npz");
    let want = |k: &str| f[k].double_value(&[]);
    let rows = fastfold::model::pair_rows::PairRows::whole(f["mask"].size()[0]);
    let ptm = predicted_tm_score_of_chains(&f["logits"], &rows, 31.0, &f["mask"], None).unwrap();
    let iptm = predicted_tm_score_of_chains(&f["logits"], &rows, 31.0, &f["mask"], Some(&f["asym_id"])).unwrap();
    let ranking = multimer_ranking_confidence(iptm, ptm);
    for (what, got, want) in [
        ("ptm", ptm, want("ptm")),
        ("iptm", iptm, want("iptm")),
        ("ranking", ranking, want("ranking_confidence") / 100.0),
    ] {
        let d = (got - want).abs();
        eprintln!("{what}: ours {got:.8}, AlphaFold {want:.8}, |difference| {d:.2e}");
        assert!(d <= TOLERANCE * want.abs(), "{what}: ours {got}, AlphaFold {want} (relative tolerance {TOLERANCE:e})");
    }
    assert!((iptm - ptm).abs() > 1e-3, "the interface score is not the whole-complex score");
    let e = predicted_tm_score_of_chains(&f["logits"], &rows, 31.0, &f["mask"].narrow(0, 0, 3), None).unwrap_err();
    assert!(e.to_string().contains("residue weights"), "{e}");
}

#[test]
fn invariant_point_attention_equals_alphafold_multimer() {
    let f = arrays("structure_module.npz");
    let module = load_structure_module(fixture("structure_module_params.npz"), 8).unwrap();
    let frames = Rigid { rot: f["ipa_rot"].shallow_clone(), trans: f["ipa_trans"].shallow_clone() };
    let out = tch::no_grad(|| {
        module.invariant_point_attention(&f["ipa_act"], &f["ipa_pair"], &f["ipa_mask"], &frames).unwrap()
    });
    common::assert_close("invariant point attention", &out, &f["ipa_out"], TOLERANCE);
}

/// Rows `dim` of `t` of the residues `seq_mask` keeps: a padding residue's attention is
/// uniform in exact arithmetic, but its logits sit near -1e5 where fp32 keeps about three
/// digits, so both implementations' padding rows are rounding noise of different draws (its
/// activations differ by 1e-3 after the first iteration here); AlphaFold masks them later.
fn real_residues(t: &Tensor, seq_mask: &Tensor, dim: i64) -> Tensor {
    t.index_select(dim, &seq_mask.nonzero().squeeze_dim(-1))
}

#[test]
fn structure_module_equals_alphafold_multimer() {
    let f = arrays("structure_module.npz");
    let module = load_structure_module(fixture("structure_module_params.npz"), 8).unwrap();
    let mask = &f["seq_mask"];
    assert_eq!(mask.sum(Kind::Float).double_value(&[]), 15.0, "one padding residue");
    for chunk in [None, Some(5)] {
        let out = tch::no_grad(|| module.run(&f["single"], &f["pair"], &f["aatype"], mask, chunk, None).unwrap());
        let check = |what: &str, got: &Tensor, want: &Tensor, dim: i64| {
            let (got, want) = (real_residues(got, mask, dim), real_residues(want, mask, dim));
            common::assert_close(&format!("{what} (chunk {chunk:?})"), &got, &want, TOLERANCE);
        };
        // AlphaFold's `traj`: [iterations, N, 3, 4], the rotation matrix with the translation as
        // a fourth column. The first iteration alone (one fold iteration from identity
        // frames), then all of them.
        let traj = &f["traj"];
        check("iteration 1 rotations", &out.rotations.get(0), &traj.get(0).narrow(-1, 0, 3), 0);
        check("iteration 1 translations", &out.translations.get(0), &traj.get(0).select(-1, 3), 0);
        check("rotations", &out.rotations, &traj.narrow(-1, 0, 3), 1);
        check("translations", &out.translations, &traj.select(-1, 3), 1);
        check("angles", &out.angles, &f["angles"], 1);
        check("unnormalized angles", &out.unnormalized_angles, &f["unnormalized_angles"], 1);
        let last = f["sc_frames"].get(-1);
        check("rigid-group rotations", &out.frames.rot, &last.narrow(-1, 0, 3), 0);
        check("rigid-group translations", &out.frames.trans, &last.select(-1, 3), 0);
        check("atom14", &out.atom14, &f["final_atom14_positions"], 0);
        check("atom37", &out.atom37, &f["final_atom_positions"], 0);
        check("single", &out.single, &f["act"], 0);
        // The padding residue's atoms are masked, as AlphaFold-Multimer's.
        common::assert_close("atom37 mask", &out.atom37_mask, &f["final_atom_mask"], 0.0);
        common::assert_close("padding atom37", &out.atom37.get(15), &f["final_atom_positions"].get(15), 0.0);
    }
    let e = load_structure_module(fixture("template_rows_params.npz"), 8).err().unwrap().to_string();
    assert!(e.contains("trainable_point_weights") && e.contains("template_rows_params.npz"), "{e}");
}

/// `t` for a stack that leaves it as it is.
fn kept(t: &Tensor) -> Stream {
    Stream::new(t.shallow_clone(), false)
}

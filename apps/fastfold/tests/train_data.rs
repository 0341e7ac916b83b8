//! Training data as users have it: an mmCIF chain read as a training target (against the PDB
//! reader on the same atoms, and against values read off the fixture by hand); OpenFold's
//! layout of mmCIF and alignment folders, its filters (the entries' values or OpenFold's chain
//! data cache) and the errors naming what is missing;
//! a chain made one step's example, its crop of the features and the ground truth aligned,
//! every draw repeated by its seed, step and rank; a chain's template hits featurised as predict
//! featurises them, filtered by the chain's release date, drawn per example and cropped with
//! the other features.
mod common;

use std::path::Path;

use fastfold::pdb::Structure;
use fastfold::residue_constants::{aatype_of, atom_order, UNK_RESTYPE_INDEX};
use fastfold::search::mmcif;
use fastfold::train_data::example::{load, prepare, Pipeline};
use fastfold::train_data::layout::{read_chain_data_cache, select, Filters};
use fastfold::train_data::target::{chain_structure, read_chain};
use fastfold::train_data::transforms::BlockDeletion;
use fastfold::train_target::Target;
use tch::Tensor;

use common::layout::{self, mmcif_fixture, query_chain_layout, template_sampling, QUERY};

/// The first model's polymer atoms of chain `chain` of an mmCIF file, as fixed-column PDB
/// records (what a PDB download of the entry holds), for the PDB reader.
fn as_pdb(cif: &str, chain: &str) -> String {
    let tags: Vec<&str> = cif.lines().filter_map(|l| l.strip_prefix("_atom_site.")).collect();
    let field = |f: &[&str], name: &str| f[tags.iter().position(|t| *t == name).unwrap()].to_string();
    let mut out = String::new();
    for (serial, line) in cif.lines().filter(|l| l.starts_with("ATOM ") || l.starts_with("HETATM ")).enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let get = |name: &str| field(&f, name);
        if get("pdbx_PDB_model_num") != "1" || get("auth_asym_id") != chain || get("label_comp_id") == "HOH" {
            continue;
        }
        let atom = get("label_atom_id");
        let name = if atom.len() == 4 { atom } else { format!(" {atom}") };
        let alt = match get("label_alt_id").as_str() {
            "." | "?" => ' ',
            a => a.chars().next().unwrap(),
        };
        let [x, y, z] = ["Cartn_x", "Cartn_y", "Cartn_z"].map(|k| get(k).parse::<f32>().unwrap());
        let occupancy: f32 = get("occupancy").parse().unwrap();
        out.push_str(&format!(
            "{:<6}{:>5} {name:<4}{alt}{:>3} {chain}{:>4}    {x:>8.3}{y:>8.3}{z:>8.3}{occupancy:>6.2} 20.00\n",
            get("group_PDB"),
            serial + 1,
            get("label_comp_id"),
            get("auth_seq_id")
        ));
    }
    out + "END\n"
}

/// The chain's atoms equal the PDB reader's on the same atoms, residue for residue over the
/// observed ones; residues never observed are in SEQRES with every atom masked; the
/// selenomethionine is a methionine whose SD is the selenium.
#[test]
fn mmcif_chain_is_the_pdb_readers_structure_over_seqres() {
    let path = mmcif_fixture("1abc");
    let chain = read_chain(&path, "A").unwrap();
    assert_eq!(chain.name, "1abc_A");
    assert_eq!(chain.sequence, "GSHYIAKQRMISFGVKSHFSRQLERLGLIEVQAPILE");
    assert_eq!(chain.release_date.as_deref(), Some("2015-06-01"));
    assert_eq!(chain.resolution, 0.0, "no resolution key in the fixture");
    let s = &chain.structure;
    assert_eq!(s.aatype.len(), 37);
    assert_eq!(s.aatype[9], aatype_of('M'), "MSE reads as MET");
    let sd = atom_order("SD").unwrap();
    assert_eq!((s.positions[9][sd], s.mask[9][sd]), ([34.660, 0.362, 1.800], 1.0), "the selenium as SD");

    let pdb_text = as_pdb(&std::fs::read_to_string(&path).unwrap(), "A");
    let pdb = Structure::parse(&pdb_text, Path::new("1abc.pdb"), Some('A')).unwrap();
    let observed: Vec<usize> = (0..37).filter(|&i| s.mask[i].iter().any(|&m| m > 0.0)).collect();
    assert!(observed.len() < 37, "the fixture leaves residues unobserved");
    assert_eq!(observed.len(), pdb.aatype.len());
    let (cd, nh1, nh2) = (atom_order("CD").unwrap(), atom_order("NH1").unwrap(), atom_order("NH2").unwrap());
    let dist = |a: [f32; 3], b: [f32; 3]| (0..3).map(|d| (a[d] - b[d]).powi(2)).sum::<f32>().sqrt();
    let mut swapped = 0;
    for (k, &i) in observed.iter().enumerate() {
        assert_eq!(s.aatype[i], pdb.aatype[k], "residue {}", i + 1);
        assert_eq!(s.mask[i], pdb.mask[k], "residue {} mask", i + 1);
        let mut theirs = pdb.positions[k];
        // The mmCIF reader names arginine's NH1 the nitrogen nearer CD (AlphaFold's
        // `_get_atom_positions`); the PDB reader keeps the file's names.
        if s.aatype[i] == aatype_of('R') && s.mask[i][nh1] > 0.0 {
            assert!(dist(s.positions[i][nh1], s.positions[i][cd]) <= dist(s.positions[i][nh2], s.positions[i][cd]));
            if dist(theirs[nh1], theirs[cd]) > dist(theirs[nh2], theirs[cd]) {
                theirs.swap(nh1, nh2);
                swapped += 1;
            }
        }
        for (a, (ours, theirs)) in s.positions[i].iter().zip(&theirs).enumerate() {
            assert!(dist(*ours, *theirs) < 1e-3, "residue {} atom {a}", i + 1);
        }
    }
    assert!(swapped > 0, "the fixture names an arginine's NH atoms the other way round");
    // A target of the features' residue types, unobserved residues and all.
    let aatype = Tensor::from_slice(&chain.sequence.chars().map(|c| aatype_of(c) as i64).collect::<Vec<_>>());
    let target = Target::new(&chain_structure(&mmcif::read(&path).unwrap().chains[0]), &aatype, "1abc_A").unwrap();
    assert_eq!(target.truth.all_atom_mask.size(), [37, 37]);
    assert!(!chain.sequence.contains('X') && !s.aatype.contains(&UNK_RESTYPE_INDEX));
}

/// The resolution is read as AlphaFold's `_get_header` reads it: refinement, then EM, then
/// reflections, skipping values that are not numbers; a chain the entry lacks is an error
/// naming the file and the chains it has.
#[test]
fn resolution_and_missing_chains() {
    let path = mmcif_fixture("3ghi");
    let text = std::fs::read_to_string(&path).unwrap();
    let with = |items: &str| mmcif::parse(&format!("{text}\n{items}\n"), &path).unwrap().resolution;
    assert_eq!(with("_refine.ls_d_res_high 2.10"), 2.1);
    assert_eq!(with("_reflns.d_resolution_high 1.8\n_refine.ls_d_res_high 2.10"), 2.1, "refinement first");
    assert_eq!(with("_refine.ls_d_res_high ?\n_em_3d_reconstruction.resolution 3.4"), 3.4);
    assert_eq!(with("_refine.ls_d_res_high .\n_reflns.d_resolution_high 1.5"), 1.5);
    assert_eq!(with("_exptl.crystals_number 1"), 0.0);
    let err = read_chain(&path, "Q").unwrap_err().to_string();
    assert!(err.contains("3ghi.cif") && err.contains("no protein chain \"Q\"") && err.contains("chains: A"), "{err}");
}

fn names(filters: &Filters, mmcif: &Path, alignments: &Path) -> Vec<String> {
    select(mmcif, alignments, filters).unwrap().chains.into_iter().map(|c| c.name).collect()
}

/// The chains are the alignment folders (or the train list), each paired with its entry and
/// its MSA files; the filters leave chains out by release date, length and resolution, and
/// say how many; what is missing is named.
#[test]
fn layout_pairs_chains_with_entries_and_filters_them() {
    let d = common::scratch("train_data", "layout");
    let (mmcif, alignments) = layout::write(&d, &["1abc_A", "2def_A", "2def_B", "3ghi_A"]);
    let all = Filters::default();
    assert_eq!(names(&all, &mmcif, &alignments), ["1abc_A", "2def_A", "2def_B", "3ghi_A"]);
    let selection = select(&mmcif, &alignments, &all).unwrap();
    let first = &selection.chains[0];
    assert_eq!((first.chain.as_str(), first.length), ("A", 37));
    assert_eq!(first.mmcif, mmcif.join("1abc.cif"));
    assert_eq!(
        first.msas,
        [alignments.join("1abc_A/bfd_uniclust_hits.a3m"), alignments.join("1abc_A/uniref90_hits.sto")]
    );
    assert!(first.templates.is_empty(), "no hit files, no templates");

    // 2def was released 2018-02-03 and 3ghi 2021-05-01; 2def_A has 26 residues, 3ghi_A 30.
    let dated = Filters { max_release_date: Some("2020-01-01".into()), ..Filters::default() };
    let selection = select(&mmcif, &alignments, &dated).unwrap();
    assert_eq!(selection.chains.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["1abc_A", "2def_A", "2def_B"]);
    assert_eq!(selection.excluded, [("released after --max-release-date".to_string(), 1)]);
    let short = Filters { max_length: Some(30), ..Filters::default() };
    assert_eq!(names(&short, &mmcif, &alignments), ["2def_A", "3ghi_A"]);
    let long = Filters { min_length: 31, ..Filters::default() };
    assert_eq!(names(&long, &mmcif, &alignments), ["1abc_A", "2def_B"]);
    let listed = Filters { train_list: Some(vec!["3ghi_A".into(), "1abc_A".into()]), ..Filters::default() };
    assert_eq!(names(&listed, &mmcif, &alignments), ["1abc_A", "3ghi_A"]);

    // Resolution: 2.5 Å passes 3, 3.5 Å does not.
    let text = std::fs::read_to_string(mmcif.join("3ghi.cif")).unwrap();
    std::fs::write(mmcif.join("3ghi.cif"), format!("{text}\n_refine.ls_d_res_high 3.5\n")).unwrap();
    let sharp = Filters { max_resolution: 3.0, ..Filters::default() };
    let selection = select(&mmcif, &alignments, &sharp).unwrap();
    assert_eq!(selection.excluded, [("resolution above --max-resolution".to_string(), 1)]);
    std::fs::write(mmcif.join("3ghi.cif"), text).unwrap();

    // OpenFold's chain data cache in place of the entries' own values (which have no
    // resolution): chains it lacks are left out.
    let cache = d.join("chain_data_cache.json");
    let record = |date: &str, seq: &str, resolution: Option<f64>| serde_json::json!({"release_date": date, "seq": seq, "resolution": resolution, "cluster_size": 1});
    let seq = |n: usize| "ACDEFGHIKLMNPQRSTVWY".chars().cycle().take(n).collect::<String>();
    let json = serde_json::json!({
        "1abc_A": record("2015-06-01", &seq(37), Some(2.0)),
        "2def_A": record("2018-02-03", &seq(26), Some(3.5)),
        "3ghi_A": record("2021-05-01", &seq(30), None),
    });
    std::fs::write(&cache, json.to_string()).unwrap();
    let cached =
        Filters { chain_data: Some(read_chain_data_cache(&cache).unwrap()), max_resolution: 3.0, ..all.clone() };
    let selection = select(&mmcif, &alignments, &cached).unwrap();
    assert_eq!(selection.chains.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["1abc_A", "3ghi_A"]);
    let mut excluded = selection.excluded.clone();
    excluded.sort();
    assert_eq!(
        excluded,
        [("not in --chain-data-cache".to_string(), 1), ("resolution above --max-resolution".to_string(), 1)]
    );
    std::fs::write(&cache, "[1, 2]").unwrap();
    let e = read_chain_data_cache(&cache).unwrap_err().to_string();
    assert!(e.contains("chain_data_cache.json") && e.contains("chain data cache"), "{e}");

    let err = |filters: &Filters| select(&mmcif, &alignments, filters).unwrap_err().to_string();
    let listed = Filters { train_list: Some(vec!["9zzz_A".into()]), ..Filters::default() };
    let e = err(&listed);
    assert!(e.contains("no alignment folder") && e.contains("9zzz_A"), "{e}");
    let none = Filters { max_length: Some(3), ..Filters::default() };
    let e = err(&none);
    assert!(e.contains("no training chains") && e.contains("4 longer than --max-length"), "{e}");
    std::fs::create_dir_all(alignments.join("1abc_Q")).unwrap();
    let e = err(&all);
    assert!(e.contains("1abc.cif") && e.contains("no protein chain \"Q\" for 1abc_Q"), "{e}");
    std::fs::remove_dir(alignments.join("1abc_Q")).unwrap();
    std::fs::create_dir_all(alignments.join("4xyz_A")).unwrap();
    let e = err(&all);
    assert!(e.contains("4xyz.cif") && e.contains("--mmcif-dir"), "{e}");
    std::fs::copy(mmcif.join("3ghi.cif"), mmcif.join("4xyz.cif")).unwrap();
    let e = err(&all);
    assert!(e.contains("4xyz_A") && e.contains("has no .a3m or .sto file"), "{e}");
}

fn pipeline(seed: u64) -> Pipeline {
    Pipeline {
        features: fastfold::features::FeatureConfig { max_msa_clusters: 4, max_extra_msa: 8, ..Default::default() },
        block_deletion: BlockDeletion::default(),
        crop_size: 16,
        max_recycles: 3,
        seed,
        templates: None,
    }
}

/// A chain's example: the MSAs of both files in one, the crop of the features at the crop of
/// the ground truth (residue types, indices), the same draws for the same seed, step and rank
/// and others for another step or rank.
#[test]
fn examples_crop_features_and_truth_alike_and_repeat_by_seed_step_and_rank() {
    let d = common::scratch("train_data", "example");
    let (mmcif, alignments) = layout::write(&d, &["1abc_A"]);
    let chain = select(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    let example = load(&chain).unwrap();
    assert_eq!(example.name, "1abc_A");
    // The query, four A3M rows and two Stockholm rows (the Stockholm query repeats it).
    assert_eq!(example.raw.msa.len(), 7);
    assert_eq!(example.raw.seq_length, 37);

    let p = pipeline(3);
    let a = prepare(&example, &p, 5, 0).unwrap();
    let f = &a.features;
    assert_eq!(f.aatype.size(), [a.recycles as i64 + 1, 16]);
    assert_eq!(f.msa_feat.size()[2], 16);
    assert_eq!(f.seq_length.int64_value(&[0]), 16);
    assert_eq!(a.structure.aatype.len(), 16);
    let aatype: Vec<i64> = Vec::try_from(f.aatype.get(0)).unwrap();
    assert_eq!(aatype, a.structure.aatype.iter().map(|&t| t as i64).collect::<Vec<_>>(), "crop at {}", a.crop_start);
    let index: Vec<i64> = Vec::try_from(f.residue_index.get(0)).unwrap();
    assert_eq!(index, (a.crop_start as i64..a.crop_start as i64 + 16).collect::<Vec<_>>());
    assert_eq!(a.structure.residue_index, index);
    assert_eq!(a.structure.positions[..], example.structure.positions[a.crop_start..a.crop_start + 16]);
    // A target of the crop.
    Target::new(&a.structure, &f.aatype.get(0), "crop").unwrap();

    let same = prepare(&example, &p, 5, 0).unwrap();
    assert_eq!((same.crop_start, same.recycles), (a.crop_start, a.recycles));
    assert!(same.features.msa_feat.equal(&f.msa_feat) && same.features.bert_mask.equal(&f.bert_mask));
    let key = |step, rank| {
        let e = prepare(&example, &p, step, rank).unwrap();
        (e.crop_start, e.recycles, Vec::<f32>::try_from(e.features.msa_feat.flatten(0, -1)).unwrap())
    };
    let here = key(5, 0);
    assert!((6..12).any(|step| key(step, 0) != here), "other steps draw otherwise");
    assert_ne!(key(5, 1).2, here.2, "another rank draws its own MSA sample and crop");
    assert_eq!(key(5, 1).1, here.1, "the recycling count is the same on every rank");
    let starts: std::collections::BTreeSet<usize> = (0..60).map(|s| key(s, 0).0).collect();
    assert!(starts.len() > 5 && starts.iter().all(|&s| s <= 37 - 16), "{starts:?}");
    // A chain shorter than the crop is kept whole.
    let whole = prepare(&example, &Pipeline { crop_size: 64, ..p }, 5, 0).unwrap();
    assert_eq!((whole.crop_start, whole.structure.aatype.len()), (0, 37));
}

/// A chain's `pdb70_hits.hhr` gives each example up to 4 templates: the hits released 60
/// days before the chain (1abc and 2def, 3ghi is too late) featurised as predict featurises
/// them (2def realigned by kalign), a number of them from 0 to 2 drawn per example and the
/// same for the same example, cropped at the crop of the other features.
#[test]
fn template_hits_become_each_examples_cropped_templates() {
    use fastfold::search::hhr;
    use fastfold::search::templates::Featurizer;
    use fastfold::search::tools::Tool;
    use fastfold::train_data::templates::TemplateSampling;

    let d = common::scratch("train_data", "templates");
    let (mmcif, alignments) = query_chain_layout(&d);
    let chain = select(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(chain.templates, [alignments.join("9qry_A/pdb70_hits.hhr")]);
    let example = load(&chain).unwrap();
    assert_eq!(example.sequence, QUERY);
    let hits = example.templates.as_ref().expect("the hits read");
    assert_eq!(
        (hits.hits.len(), hits.query_pdb.as_str(), hits.release_date.as_deref()),
        (3, "9qry", Some("2021-06-01"))
    );

    // Predict's featurisation of the same hits with the chain's cutoff, 60 days before it.
    let path = alignments.join("9qry_A/pdb70_hits.hhr");
    let parsed = hhr::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    let predict = Featurizer {
        mmcif_dir: mmcif.clone(),
        max_template_date: "2021-04-02".into(),
        obsolete: Default::default(),
        kalign: Tool::new("kalign", None),
        unique_sequences: false,
    }
    .get_templates(QUERY, &parsed)
    .unwrap();
    let names: Vec<&str> = predict.hits.iter().map(|h| h.domain_name.as_str()).collect();
    assert_eq!(names, ["2def_B", "1abc_A"]);

    let sampling = template_sampling(&mmcif);
    let p = Pipeline { templates: Some(sampling.clone()), ..pipeline(3) };
    let (ca, crop) = (atom_order("CA").unwrap() as i64, 16usize);
    let mut counts = std::collections::BTreeSet::new();
    let mut used = std::collections::BTreeSet::new();
    for step in 1..=24 {
        let e = prepare(&example, &p, step, 0).unwrap();
        let t = e.features.templates.as_ref().expect("template features");
        let r = e.recycles as i64 + 1;
        assert_eq!(t.aatype.size(), [r, 4, crop as i64]);
        assert_eq!(t.all_atom_positions.size(), [r, 4, crop as i64, 37, 3]);
        let mask = Vec::<f32>::try_from(t.mask.get(0)).unwrap();
        let real = mask.iter().filter(|&&m| m == 1.0).count();
        assert!(mask[..real].iter().all(|&m| m == 1.0) && mask[real..].iter().all(|&m| m == 0.0), "{mask:?}");
        counts.insert(real);
        let window = e.crop_start..e.crop_start + crop;
        for k in 0..real as i64 {
            let aatype = Vec::<i64>::try_from(t.aatype.get(0).get(k)).unwrap();
            let positions = t.all_atom_positions.get(0).get(k);
            // The slot holds one of predict's hits, cut to the crop.
            let matched = predict.hits.iter().find(|h| {
                let expected: Vec<i64> = h.sequence[window.clone()]
                    .chars()
                    .map(|c| if c == '-' { 21 } else { aatype_of(c) as i64 })
                    .collect();
                let flat: Vec<f32> = h.positions[window.clone()].iter().flatten().flatten().copied().collect();
                let theirs = Tensor::from_slice(&flat).reshape([crop as i64, 37, 3]);
                expected == aatype && positions.equal(&theirs)
            });
            let hit = matched.unwrap_or_else(|| panic!("example {step} slot {k} is no hit of predict's, cropped"));
            let ca_mask: Vec<f32> = hit.masks[window.clone()].iter().map(|m| m[ca as usize]).collect();
            assert_eq!(Vec::<f32>::try_from(t.all_atom_masks.get(0).get(k).select(1, ca)).unwrap(), ca_mask);
            used.insert(hit.domain_name.clone());
        }
        let again = prepare(&example, &p, step, 0).unwrap();
        let t2 = again.features.templates.unwrap();
        assert!(t2.all_atom_positions.equal(&t.all_atom_positions) && t2.mask.equal(&t.mask), "example {step} repeats");
    }
    assert_eq!(counts.into_iter().collect::<Vec<_>>(), [0, 1, 2], "0 to 2 of the 2 usable hits, drawn per example");
    assert_eq!(used.into_iter().collect::<Vec<_>>(), ["1abc_A", "2def_B"]);

    // An entry that obsolete.dat withdraws (--obsolete-pdbs-path) gives no template.
    let obsolete = fastfold::search::templates::parse_obsolete("OBSLTE    31-JUL-94 1ABC\n");
    let p = Pipeline { templates: Some(TemplateSampling { obsolete, ..sampling.clone() }), ..pipeline(3) };
    let counts: std::collections::BTreeSet<usize> = (1..=24)
        .map(|step| {
            let t = prepare(&example, &p, step, 0).unwrap().features.templates.expect("template features");
            Vec::<f32>::try_from(t.mask.get(0)).unwrap().iter().filter(|&&m| m == 1.0).count()
        })
        .collect();
    assert_eq!(counts.into_iter().collect::<Vec<_>>(), [0, 1], "2def_B alone: 1abc is withdrawn");

    // Every .hhr file of the folder gives hits, as OpenFold reads them.
    std::fs::copy(&path, alignments.join("9qry_A/more_hits.hhr")).unwrap();
    let two = select(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(two.templates, [alignments.join("9qry_A/more_hits.hhr"), path.clone()]);
    assert_eq!(load(&two).unwrap().templates.unwrap().hits.len(), 6);
    std::fs::remove_file(alignments.join("9qry_A/more_hits.hhr")).unwrap();
    // Without sampling, or without a hit file, no templates as before.
    assert!(prepare(&example, &pipeline(3), 1, 0).unwrap().features.templates.is_none());
    // 2def_B needs kalign: a missing one is an error naming it, the flag and the hit file.
    let missing = TemplateSampling { kalign: Some(d.join("no-kalign")), ..sampling };
    let p = Pipeline { templates: Some(missing), ..pipeline(3) };
    let err = format!("{:#}", prepare(&example, &p, 1, 0).unwrap_err());
    assert!(
        err.contains("kalign")
            && err.contains("--kalign-binary-path")
            && err.contains("pdb70_hits.hhr")
            && err.contains("9qry_A"),
        "{err}"
    );
}

/// A chain folder holding hmmsearch's hits as OpenFold names them (`hmm_output.sto`, the
/// fixtures' hmmsearch result) beside its `pdb70_hits.hhr`: the `.sto` is the chain's template
/// hits (AlphaFold-Multimer's search wins; the two are never mixed), not an MSA, and over
/// examples 1-8 every drawn hit is predict's featurisation of the same hit with the chain's
/// date limit (60 days before its release: 3ghi_A is dropped), in the template slot it was
/// drawn to, bit for bit (the whole chain: a crop of 64). A folder with the `.sto` alone gives
/// the same templates.
#[test]
fn a_chains_hmmsearch_hits_become_its_examples_templates() {
    use common::layout::{check_drawn_as_predicted, hmmsearch_fixture, predict_hmmsearch_features};
    use fastfold::train_data::templates::HitSearch;

    let d = common::scratch("train_data", "hmmsearch");
    let (mmcif, alignments) = query_chain_layout(&d);
    let sto = alignments.join("9qry_A/hmm_output.sto");
    std::fs::copy(hmmsearch_fixture(), &sto).unwrap();
    let chain = select(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(chain.templates, std::slice::from_ref(&sto), "hmmsearch's hits, not the .hhr");
    assert_eq!(chain.msas, [alignments.join("9qry_A/bfd_uniclust_hits.a3m")], "the .sto is no MSA");
    let example = load(&chain).unwrap();
    let hits = example.templates.as_ref().expect("the hits read");
    assert_eq!((hits.search, hits.hits.len()), (HitSearch::Hmmsearch, 3));

    let predicted = predict_hmmsearch_features(&sto, QUERY, &mmcif, "2021-04-02");
    let sampling = template_sampling(&mmcif);
    let p = Pipeline { templates: Some(sampling.clone()), crop_size: 64, ..pipeline(3) };
    let draws = |example: &fastfold::train_data::example::Example| -> Vec<Vec<String>> {
        let hits = example.templates.as_ref().unwrap();
        (1..=8)
            .map(|step| {
                let drawn = sampling.draw(QUERY, hits, (p.seed, step, 0)).unwrap();
                let e = prepare(example, &p, step, 0).unwrap();
                let t = e.features.templates.expect("template features");
                assert_eq!(e.crop_start, 0, "the whole chain");
                let mask = Vec::<f32>::try_from(t.mask.get(0)).unwrap();
                assert_eq!(mask.iter().filter(|&&m| m == 1.0).count(), drawn.len(), "example {step}: {mask:?}");
                let (positions, masks) = (t.all_atom_positions.get(0), t.all_atom_masks.get(0));
                check_drawn_as_predicted(&drawn, &predicted, Some((&positions, &masks)), 0)
            })
            .collect()
    };
    let with_hhr = draws(&example);
    eprintln!(
        "predict's hits {:?}; drawn per example {with_hhr:?}",
        predicted.iter().map(|h| &h.domain_name).collect::<Vec<_>>()
    );
    assert!(with_hhr.iter().flatten().all(|name| name != "3ghi_A"), "a hit released too late: {with_hhr:?}");
    assert!(with_hhr.iter().any(|d| !d.is_empty()), "no template drawn: {with_hhr:?}");

    std::fs::remove_file(alignments.join("9qry_A/pdb70_hits.hhr")).unwrap();
    let alone = select(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(alone.templates, std::slice::from_ref(&sto));
    assert_eq!(draws(&load(&alone).unwrap()), with_hhr, "the .sto alone gives the same templates");
}

/// `fastfold train` on a chain with template hits and a model with a template stack: the
/// steps train (finite losses) and the template stack's parameters move; a bad
/// `--max-templates` or `--max-template-date` is named.
#[test]
fn train_command_trains_with_a_chains_templates() {
    use fastfold::model::{EvoformerConfig, ModelConfig, Params, TemplateConfig};
    let d = common::scratch("train_data", "train-templates");
    let (mmcif, alignments) = query_chain_layout(&d);
    let params = d.join("init.npz");
    let model = ModelConfig { templates: Some(TemplateConfig::tiny()), ..ModelConfig::tiny() };
    Params::random_model(&EvoformerConfig::tiny(), &model, 15).unwrap().save(&params).unwrap();
    let out = d.join("out");
    let path = |p: &Path| p.display().to_string();
    let mut args = vec!["train".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
    args.extend([path(&alignments), "--params".into(), path(&params), "-o".into(), path(&out)]);
    let flags = ["--steps", "3", "--crop-size", "16", "--max-msa-clusters", "4", "--max-extra-msa", "8"];
    let run = |extra: &[&str]| {
        let o = std::process::Command::new(common::BIN).args(&args).args(flags).args(extra).output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let (ok, text) = run(&["--max-recycles", "0", "--max-templates", "4"]);
    assert!(ok, "{text}");
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 3);
    assert!(steps.iter().all(|s| s["loss"].as_f64().unwrap().is_finite()), "{steps:?}");
    let before: std::collections::HashMap<String, Tensor> = Tensor::read_npz(&params).unwrap().into_iter().collect();
    let after = Tensor::read_npz(out.join("params.npz")).unwrap();
    let moved = after
        .iter()
        .filter(|(k, _)| k.contains("template_embedding") || k.contains("template_single_embedding"))
        .filter(|(k, v)| !v.equal(&before[k.as_str()]))
        .count();
    assert!(moved > 0, "the template stack trained");

    let (ok, text) = run(&["--max-templates", "5"]);
    assert!(!ok && text.contains("--max-templates"), "{text}");
    let (ok, text) = run(&["--max-template-date", "2021-02-30"]);
    assert!(!ok && text.contains("--max-template-date") && text.contains("YYYY-MM-DD"), "{text}");
}

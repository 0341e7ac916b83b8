//! Training AlphaFold-Multimer on a complex, with the tiny Multimer parameters of
//! `fixtures/multimer_network/model_params.npz`: `fastfold train` on a homodimer (a FASTA file of
//! two records and a PDB file of chains A and B) lowers the loss, logs Multimer's terms and
//! writes parameters that load again; the gradients of the training loss with the truth's two
//! copies swapped equal those with them in order (the chain permutation alignment at work in
//! training); a heterodimer's loss falls through the library's steps; with its chains' saved
//! alignments (`--msas`, predict's `msas/` layout) its features have their rows and its loss
//! falls; cropped to `--crop-size`, each example's features are the truth's residues and train,
//! a homodimer's differently cropped copies aligned; on several ranks (one DAP group, data-parallel
//! replicas, both) the gradients and loss equal one process's accumulating the same examples,
//! through the library and the command (`--nproc`, `--dap`, `--zero 1`); `--precision bf16`
//! trains with fp32 masters near fp32's losses; with `--template-mmcif-dir` each example draws
//! templates from the hits saved beside the chains' alignments (hhsearch's, or hmmsearch's
//! featurised as predict featurises them), repeatably; each example draws its recycles from
//! its number; what does not fit, or is not supported yet, is refused naming the flag or file.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use engine::dist::{ProcessGroup, World};
use engine::job::{OptimizerArgs, OptimizerKind};
use fastfold::complex_crop::CropKind;
use fastfold::model::multimer::{load_multimer_params, network_key, MultimerAlphaFold, MULTIMER_STRUCTURE_ITERATIONS};
use fastfold::model::recycling::Recycling;
use fastfold::model::Exec;
use fastfold::pdb::Structure;
use fastfold::train::{ComplexExample, Trainer};
use fastfold::train_complex::{ComplexSource, TrainingComplex};
use fastfold::train_data::loader::Shard;
use fastfold::train_data::templates::{read_hits, TemplateSampling};
use fastfold::train_data::transforms::sample_recycles;
use fastfold::train_parallel::{mean_over_replicas, ParallelArgs};
use suite_tests::dist_test;
use tch::{Device, Kind, Tensor};

use common::layout::{
    check_drawn_as_predicted, hmmsearch_fixture, predict_hmmsearch_features, template_sampling, QUERY,
};
use common::{step_log, BIN};

const CHAIN: &str = "MKTAYIAKGRQ";

fn tiny_multimer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network/model_params.npz")
}

/// A complex's files in `dir`: `<name>.fasta` of `records` (AlphaFold-Multimer's chains A, B,
/// ... in FASTA order, which is the features' order when copies of a sequence are adjacent) and
/// `<name>.pdb`, its truth: the tiny model's own prediction with 0.5 Å noise, each chain moved
/// 2 Å more than the one before, as chains A, B, ...; returns them, the truth's positions and
/// a writer of other positions as such a PDB file.
fn complex(dir: &Path, name: &str, records: &[&str]) -> (PathBuf, PathBuf, Tensor, impl Fn(&Tensor, &Path)) {
    let fasta = dir.join(format!("{name}.fasta"));
    let text: String = records.iter().enumerate().map(|(k, r)| format!(">r{k}\n{r}\n")).collect();
    std::fs::write(&fasta, text).unwrap();
    let params = load_multimer_params(&tiny_multimer()).unwrap();
    let net = MultimerAlphaFold::from_params(&params, MULTIMER_STRUCTURE_ITERATIONS).unwrap();
    let records = data::fasta::read(&fasta).unwrap();
    let complex = fastfold::multimer::Complex::new(&records, &fasta).unwrap();
    let entities = fastfold::multimer::EntityInput::single_sequences(&complex, &fasta).unwrap();
    let features = fastfold::multimer::features(&complex, &entities).unwrap();
    let inputs =
        fastfold::model::multimer::MultimerInputs::from_named(|n| features.get(n).map(|a| a.tensor()), name).unwrap();
    let recycling = Recycling { max: 0, early_stop_tolerance: 0.0 };
    let (pass, _) = tch::no_grad(|| net.predict(&inputs, recycling, network_key(0), &Exec::serial())).unwrap();
    let n = inputs.residues().unwrap();
    tch::manual_seed(11);
    let chain = inputs.asym_id.to_kind(Kind::Float) - 1.0;
    let positions = pass.structure.atom37.detach()
        + Tensor::randn([n, 37, 3], tch::kind::FLOAT_CPU) * 0.5
        + chain.view([n, 1, 1]) * Tensor::from_slice(&[2.0f32, 0.0, 0.0]);
    let mask = pass.structure.atom37_mask.to_kind(Kind::Float);
    let asym: Vec<i64> = Vec::try_from(inputs.asym_id.to_kind(Kind::Int64)).unwrap();
    let letters: Vec<char> = asym.iter().map(|&a| (b'A' + a as u8 - 1) as char).collect();
    let (aatype, residue_index) = (inputs.aatype.shallow_clone(), inputs.residue_index.shallow_clone());
    let write = move |positions: &Tensor, path: &Path| {
        let b_factors = Tensor::zeros([n], tch::kind::FLOAT_CPU);
        let s = Structure::from_tensors(&aatype, &residue_index, positions, &mask, &b_factors).unwrap();
        s.write_with_chains(path, &letters).unwrap();
    };
    let pdb = dir.join(format!("{name}.pdb"));
    write(&positions, &pdb);
    (fasta, pdb, positions, write)
}

/// A homodimer of two [`CHAIN`] records ([`complex`]: `dimer.fasta`, `dimer.pdb`) and
/// `swapped.pdb`, the same copies with B's atoms under A and A's under B.
fn homodimer(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let (fasta, pdb, positions, write) = complex(dir, "dimer", &[CHAIN, CHAIN]);
    let n = positions.size()[0];
    let half = n / 2;
    let swap = Tensor::cat(
        &[Tensor::arange_start(half, n, tch::kind::INT64_CPU), Tensor::arange(half, tch::kind::INT64_CPU)],
        0,
    );
    let swapped = dir.join("swapped.pdb");
    write(&positions.index_select(0, &swap), &swapped);
    (fasta, pdb, swapped)
}

/// The complex of `fasta` (its alignments in `msas`) and its truth `pdb` at 2 Å, whole.
fn read(fasta: &Path, msas: Option<&Path>, pdb: &Path) -> anyhow::Result<TrainingComplex> {
    TrainingComplex::read(fasta, msas, pdb, 2.0, None, Device::Cpu)
}

fn adam(lr: f64) -> OptimizerArgs {
    OptimizerArgs { optimizer: OptimizerKind::Adamw, lr, weight_decay: 0.0, clip_grad: Some(0.1), adam_epsilon: None }
}

/// The training loss's gradient with the truth's copies swapped equals the one with them in
/// order (within 1e-6 of each array's largest; the alignment restores the same truth), and
/// the truth files do differ; the gradient reaches the Evoformer, the structure module and the
/// heads. With the stacks' blocks checkpointed, the gradients are the same, and the arrays
/// without one are the same.
#[test]
fn swapped_copies_in_the_truth_give_the_same_gradients() {
    let dir = common::scratch("train_complex", "swap");
    let (fasta, pdb, swapped) = homodimer(&dir);
    let params = load_multimer_params(&tiny_multimer()).unwrap();
    let gradients = |target: &Path, checkpointed: bool| {
        let TrainingComplex { inputs, target, .. } = read(&fasta, None, target).unwrap();
        let mut trainer = Trainer::new(&params, Device::Cpu, &adam(1e-3)).unwrap();
        let exec = Exec::serial().with_checkpointed_blocks(checkpointed);
        let losses = trainer.backward_complex(&inputs, &target, 1, &exec).unwrap();
        let grads: Vec<(String, Tensor)> = trainer.params().iter().map(|(k, t)| (k.to_string(), t.grad())).collect();
        (losses.terms.loss, grads, target.truth.all_atom_positions.shallow_clone())
    };
    let (loss, grads, truth) = gradients(&pdb, false);
    let (swapped_loss, swapped_grads, swapped_truth) = gradients(&swapped, false);
    let moved = (&truth - &swapped_truth).abs().max().double_value(&[]);
    assert!(moved > 1.0, "the swapped file moves atoms by {moved} Å");
    assert!((loss - swapped_loss).abs() <= 1e-6 * loss.abs(), "loss {loss} in order, {swapped_loss} swapped");
    let mut nonzero = 0;
    for ((name, g), (_, h)) in grads.iter().zip(&swapped_grads) {
        // An array outside the graph (the extra-MSA stack's, on a complex without extra rows,
        // some) has none either way.
        assert_eq!(g.defined(), h.defined(), "{name}: a gradient in one order only");
        if !g.defined() {
            continue;
        }
        let scale = g.abs().max().double_value(&[]);
        let diff = (g - h).abs().max().double_value(&[]);
        assert!(diff <= 1e-6 * scale.max(1e-12), "{name}: gradients differ by {diff:e} (largest {scale:e})");
        nonzero += usize::from(scale > 0.0);
    }
    for scope in ["evoformer_iteration", "structure_module", "distogram_head", "masked_msa_head"] {
        let reached =
            grads.iter().any(|(k, g)| k.contains(scope) && g.defined() && g.abs().max().double_value(&[]) > 0.0);
        assert!(reached, "no gradient reaches {scope}");
    }
    eprintln!("{nonzero} of {} arrays have a gradient; loss {loss}", grads.len());

    // Gradient checkpointing of the stacks' blocks (--gradient-checkpointing) recomputes them
    // in backward: the same gradients, within 1e-5 of each array's largest (fp32 rounding).
    let (checkpointed_loss, checkpointed, _) = gradients(&pdb, true);
    assert!((loss - checkpointed_loss).abs() <= 1e-6 * loss.abs(), "loss {loss}, checkpointed {checkpointed_loss}");
    for ((name, g), (_, h)) in grads.iter().zip(&checkpointed) {
        // A block's array outside the graph gets none, through the recomputation too.
        assert_eq!(g.defined(), h.defined(), "{name}: a gradient with checkpointing or without only");
        if !g.defined() {
            continue;
        }
        let scale = g.abs().max().double_value(&[]);
        let diff = (g - h).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5 * scale.max(1e-12),
            "{name}: checkpointed gradient differs by {diff:e} (largest {scale:e})"
        );
    }
}

/// A complex's training step on the fused kernels (`fastfold train --kernels fused`, the GPU's
/// default) gives the compositions' loss within 1e-5 and every gradient within 1e-4 of its
/// array's largest (plus 1e-6 of the largest of all, for arrays whose gradient is float noise):
/// on a GPU, else on the CPU emulator (gpu-check runs it there).
#[test]
fn complex_gradients_on_the_fused_kernels_equal_the_compositions_on_cuda_or_the_emulator() {
    let dev = suite_tests::cuda_or_emulator(
        "complex_gradients_on_the_fused_kernels_equal_the_compositions_on_cuda_or_the_emulator",
        kernels::emulator::enable,
    );
    let dir = common::scratch("train_complex", "fused");
    let (fasta, pdb, _) = homodimer(&dir);
    let gradients = |backend| {
        let params = load_multimer_params(&tiny_multimer()).unwrap().with_kernels(backend);
        let TrainingComplex { inputs, target, .. } = read(&fasta, None, &pdb).unwrap();
        let mut trainer = Trainer::new(&params, dev, &adam(1e-3)).unwrap();
        let losses = trainer.backward_complex(&inputs, &target, 1, &Exec::serial()).unwrap();
        let on_cpu = |g: Tensor| if g.defined() { g.to_device(Device::Cpu) } else { g };
        let grads: Vec<(String, Tensor)> =
            trainer.params().iter().map(|(k, t)| (k.to_string(), on_cpu(t.grad()))).collect();
        (losses.terms.loss, grads)
    };
    let (loss, torch) = gradients(kernels::Backend::Torch);
    let (fused_loss, fused) = gradients(kernels::Backend::Fused);
    assert!((loss - fused_loss).abs() <= 1e-5 * loss.abs(), "loss {loss} torch, {fused_loss} fused");
    let largest = |g: &Tensor| if g.defined() { g.abs().max().double_value(&[]) } else { 0.0 };
    // An array whose gradient is all but zero (float noise) is judged against 1e-6 of the
    // largest gradient of all.
    let floor = 1e-6 * torch.iter().map(|(_, g)| largest(g)).fold(0.0, f64::max);
    for ((name, g), (_, h)) in torch.iter().zip(&fused) {
        assert_eq!(g.defined(), h.defined(), "{name}: a gradient with one backend only");
        if g.defined() {
            let (scale, diff) = (largest(g), (g - h).abs().max().double_value(&[]));
            assert!(diff <= 1e-4 * scale + floor, "{name}: fused gradient differs by {diff:e} (largest {scale:e})");
        }
    }
}

fn train(args: &[String]) -> (bool, String) {
    let o = Command::new(BIN).arg("train").args(args).output().unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

fn words(fasta: &Path, target: &Path, out: &Path) -> Vec<String> {
    let path = |p: &Path| p.display().to_string();
    let params = tiny_multimer();
    vec![path(fasta), "--target".into(), path(target), "--params".into(), path(&params), "-o".into(), path(out)]
}

/// `fastfold train --model-preset multimer` on the complex `fasta` and its truth `pdb` (the tiny
/// parameters) into `out` with `flags`: each step's record of its log (a failure fails the test,
/// with the run's output).
fn train_logged(fasta: &Path, pdb: &Path, out: &Path, flags: &[&str]) -> Vec<serde_json::Value> {
    let mut args = words(fasta, pdb, out);
    args.extend(["--model-preset", "multimer"].iter().chain(flags).map(|s| s.to_string()));
    let (ok, text) = train(&args);
    assert!(ok, "{}: {text}", out.display());
    step_log(out)
}

/// `fastfold train --model-preset multimer` on the homodimer: 5 steps lower the loss (the last
/// step's below the first's), every step logs Multimer's terms (finite; the aligned-error term
/// with the PAE head), and the saved parameters load as Multimer's again.
#[test]
fn train_on_a_homodimer_lowers_the_loss() {
    let dir = common::scratch("train_complex", "train");
    let (fasta, pdb, _) = homodimer(&dir);
    let out = dir.join("out");
    let mut args = words(&fasta, &pdb, &out);
    let flags = ["--model-preset", "multimer", "--steps", "5", "--lr", "3e-3", "--warmup", "0", "--resolution", "2"];
    // No recycles, the fixed count this test was measured with before they were drawn.
    args.extend(flags.iter().chain(&["--max-recycles", "0"]).map(|s| s.to_string()));
    let (ok, text) = train(&args);
    assert!(ok, "{text}");
    assert!(text.contains("AlphaFold-Multimer's loss weights"), "{text}");
    let log = step_log(&out);
    assert_eq!(log.len(), 5);
    assert!(log.iter().all(|s| s["recycles"] == 0), "--max-recycles 0 draws none: {log:?}");
    let loss: Vec<f64> = log.iter().map(|s| s["loss"].as_f64().unwrap()).collect();
    eprintln!("losses {loss:?}");
    for s in &log {
        for term in ["fape", "sidechain_fape", "chi", "violation", "distogram", "masked_msa", "plddt", "aligned_error"]
        {
            assert!(s[term].as_f64().is_some_and(f64::is_finite), "step {}: {term} {}", s["step"], s[term]);
        }
    }
    assert!(loss[4] < loss[0], "the loss did not fall: {loss:?}");
    let saved = load_multimer_params(&out.join("params.npz")).unwrap();
    assert!(MultimerAlphaFold::from_params(&saved, MULTIMER_STRUCTURE_ITERATIONS).is_ok());
}

/// A record that the structure lacks or whose length differs, a one-record FASTA file, and
/// the options not supported yet for a complex are refused, naming the chain, file or flag;
/// nothing is trained.
#[test]
fn what_does_not_fit_a_complex_is_refused_by_name() {
    let dir = common::scratch("train_complex", "refused");
    let (fasta, pdb, _) = homodimer(&dir);
    let out = dir.join("out");
    let refused = |fasta: &Path, extra: &[&str], expect: &[&str]| {
        let mut args = words(fasta, &pdb, &out);
        args.extend(["--model-preset", "multimer"].iter().chain(extra).map(|s| s.to_string()));
        let (ok, text) = train(&args);
        assert!(!ok, "trained: {text}");
        for e in expect {
            assert!(text.contains(e), "no {e:?} in: {text}");
        }
        assert!(!out.join("params.npz").exists(), "parameters written");
    };
    let three = dir.join("three.fasta");
    std::fs::write(&three, format!(">a\n{CHAIN}\n>b\n{CHAIN}\n>c\nMKTAY\n")).unwrap();
    refused(&three, &[], &["--target", "chain C", "\"c\""]);
    let longer = dir.join("longer.fasta");
    std::fs::write(&longer, format!(">a\n{CHAIN}\n>b\n{CHAIN}A\n")).unwrap();
    refused(&longer, &[], &["chain B has 11 residues", "\"b\" has 12"]);
    let one = dir.join("one.fasta");
    std::fs::write(&one, format!(">a\n{CHAIN}\n")).unwrap();
    refused(&one, &[], &["several FASTA records"]);
    let a3m = dir.join("a.a3m");
    std::fs::write(&a3m, format!(">a\n{CHAIN}\n")).unwrap();
    refused(&fasta, &["--msa", a3m.to_str().unwrap()], &["--msa", "not supported yet"]);
    refused(&fasta, &["--chain", "A"], &["--chain", "not supported yet"]);
    refused(&fasta, &["--recycles", "1"], &["--recycles 1", "--max-recycles"]);
}

/// A heterodimer (two entities, their query rows paired across chains; the unique chain anchors
/// the alignment) trains too through the library: 3 steps of `Trainer::accumulate_complex`
/// lower the loss, every term finite.
#[test]
fn a_heterodimer_trains_and_its_loss_falls() {
    let dir = common::scratch("train_complex", "heterodimer");
    let (fasta, pdb, _, _) = complex(&dir, "hetero", &[CHAIN, "GSWEDLKKLAE"]);
    let TrainingComplex { inputs, target, .. } = read(&fasta, None, &pdb).unwrap();
    let params = load_multimer_params(&tiny_multimer()).unwrap();
    let mut trainer = Trainer::new(&params, Device::Cpu, &adam(3e-3)).unwrap();
    let exec = Exec::serial();
    let mut losses = Vec::new();
    for number in 1..=3 {
        trainer.begin_step(1).unwrap();
        let example = ComplexExample { features: &inputs, target: &target, recycles: 1, number };
        trainer.accumulate_complex(&example, &exec).unwrap();
        let (terms, norm) = trainer.finish_step(&exec).unwrap();
        assert!(norm.is_finite() && norm > 0.0, "step {number}: gradient norm {norm}");
        let values =
            [terms.fape, terms.sidechain_fape, terms.violation, terms.distogram, terms.masked_msa, terms.plddt];
        assert!(values.iter().chain(&terms.aligned_error).all(|v| v.is_finite()), "step {number}: {terms:?}");
        losses.push(terms.loss);
    }
    eprintln!("losses {losses:?}");
    assert!(losses[2] < losses[0], "the loss did not fall: {losses:?}");
}

/// `sequence` with residue `(k * 3 + j * 5) % n` changed for j < `changes`: hit `k`'s row.
fn mutant(sequence: &str, k: usize, changes: usize) -> String {
    let mut residues: Vec<char> = sequence.chars().collect();
    let n = residues.len();
    for j in 0..changes {
        let i = (k * 3 + j * 5) % n;
        residues[i] = if residues[i] == 'A' { 'W' } else { 'A' };
    }
    residues.into_iter().collect()
}

/// A Stockholm alignment of `query` and `hits` named rows (no gaps).
fn stockholm(query: &str, hits: &[(String, String)]) -> String {
    let mut text = String::from("# STOCKHOLM 1.0\n\n");
    for (name, _) in hits {
        text += &format!("#=GS {name} DE synthetic hit\n");
    }
    text += &format!("\nquery {query}\n");
    for (name, row) in hits {
        text += &format!("{name} {row}\n");
    }
    text + "//\n"
}

/// Predict's `msas/` layout for chains `chains` (id, sequence), AlphaFold's full_dbs files:
/// `<id>/uniref90_hits.sto` (4 hits), `mgnify_hits.sto` (2), `bfd_uniref_hits.a3m` (2) and
/// `uniprot_hits.sto` (3 hits, of HUMAN, MOUSE and YEAST: the rows paired across chains).
fn saved_alignments(msas: &Path, chains: &[(char, &str)]) {
    for (id, sequence) in chains {
        let dir = msas.join(id.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let hits = |db: &str, first: usize, count: usize| -> Vec<(String, String)> {
            (first..first + count).map(|k| (format!("{db}_{id}{k}/1-11"), mutant(sequence, k, 2))).collect()
        };
        std::fs::write(dir.join("uniref90_hits.sto"), stockholm(sequence, &hits("UniRef90", 1, 4))).unwrap();
        std::fs::write(dir.join("mgnify_hits.sto"), stockholm(sequence, &hits("MGYP", 5, 2))).unwrap();
        let a3m: String = hits("BFD", 7, 2).iter().map(|(n, r)| format!(">{n}\n{r}\n")).collect();
        std::fs::write(dir.join("bfd_uniref_hits.a3m"), format!(">query\n{sequence}\n{a3m}")).unwrap();
        let uniprot: Vec<(String, String)> = ["HUMAN", "MOUSE", "YEAST"]
            .iter()
            .enumerate()
            .map(|(k, species)| (format!("tr|Q{id}0000{k}|Q{id}0000{k}_{species}/1-11"), mutant(sequence, k + 9, 3)))
            .collect();
        std::fs::write(dir.join("uniprot_hits.sto"), stockholm(sequence, &uniprot)).unwrap();
    }
}

/// A heterodimer with its chains' saved alignments (`--msas`, predict's layout): its features
/// have the alignments' rows (20 against the single-sequence features' 1: the rows paired by
/// species, then each chain's hits), and `fastfold train --msas` lowers its loss over
/// 4 steps, every term finite. A chain's missing alignment is refused naming `--msas`, the
/// chain and the file; so is a missing folder, and `--msas` on a monomer's parameters is not
/// taken silently (the flag is named).
#[test]
fn a_heterodimer_trains_on_its_saved_alignments() {
    let dir = common::scratch("train_complex", "msas");
    const OTHER: &str = "GSWEDLKKLAE";
    let (fasta, pdb, _, _) = complex(&dir, "hetero", &[CHAIN, OTHER]);
    let msas = dir.join("msas");
    saved_alignments(&msas, &[('A', CHAIN), ('B', OTHER)]);

    let single = read(&fasta, None, &pdb).unwrap().inputs;
    let TrainingComplex { inputs: aligned, target, .. } = read(&fasta, Some(&msas), &pdb).unwrap();
    // Rows with a real residue (the features' MSA is padded to 512 rows).
    let rows = |i: &fastfold::model::multimer::MultimerInputs| {
        i.msa_mask.sum_dim_intlist(1, false, Kind::Float).gt(0.0).sum(Kind::Int64).int64_value(&[])
    };
    let real = |i: &fastfold::model::multimer::MultimerInputs| i.msa_mask.sum(Kind::Float).double_value(&[]);
    eprintln!("msa rows: single {}, aligned {} ({} real residues)", rows(&single), rows(&aligned), real(&aligned));
    assert_eq!(aligned.residues().unwrap(), 22);
    assert_eq!(target.truth.all_atom_positions.size()[0], 22);
    // Single sequences: the paired query row alone. With the alignments: the query row and the
    // 3 species' rows paired across the chains (HUMAN, MOUSE, YEAST), then each chain's 8
    // database hits unpaired (its query row, already paired, dropped as a duplicate).
    assert_eq!(rows(&single), 1);
    assert_eq!(rows(&aligned), 4 + 2 * 8, "rows with a residue");
    assert_eq!(real(&aligned), 20.0 * 22.0, "every real row covers both chains' columns");

    let out = dir.join("out");
    let mut args = words(&fasta, &pdb, &out);
    let flags = ["--model-preset", "multimer", "--steps", "4", "--lr", "3e-3", "--warmup", "0", "--resolution", "2"];
    args.extend(flags.iter().chain(&["--max-recycles", "0"]).map(|s| s.to_string()));
    args.extend(["--msas".to_string(), msas.display().to_string()]);
    let (ok, text) = train(&args);
    assert!(ok, "{text}");
    let log = step_log(&out);
    let loss: Vec<f64> = log.iter().map(|s| s["loss"].as_f64().unwrap()).collect();
    eprintln!("losses {loss:?}");
    assert_eq!(loss.len(), 4);
    assert!(loss.iter().all(|l| l.is_finite()), "{loss:?}");
    assert!(loss[3] < loss[0], "the loss did not fall: {loss:?}");

    let missing = msas.join("B").join("uniprot_hits.sto");
    std::fs::remove_file(&missing).unwrap();
    let refusal = |msas: &Path| match read(&fasta, Some(msas), &pdb) {
        Ok(_) => panic!("read without {}", missing.display()),
        Err(e) => format!("{e:#}"),
    };
    let err = refusal(&msas);
    for expect in ["--msas", "chain B", &missing.display().to_string()] {
        assert!(err.contains(expect), "no {expect:?} in: {err}");
    }
    let nowhere = dir.join("nowhere");
    let err = refusal(&nowhere);
    assert!(err.contains("--msas") && err.contains(&nowhere.display().to_string()), "{err}");
    let out = dir.join("refused");
    let mut args = words(&fasta, &pdb, &out);
    args.extend(["--msas".to_string(), msas.display().to_string(), "--msa".into(), pdb.display().to_string()]);
    let (ok, text) = train(&args);
    assert!(!ok && text.contains("--msas") && text.contains("--msa"), "{text}");
}

/// A heterodimer whose chain A (the template fixtures' 40-residue query) has hhsearch's hits
/// saved in its `--msas` folder (`A/pdb_hits.hhr`, as predict saves them; chain B has none),
/// drawing templates from the fixtures' entries (`--template-mmcif-dir`): each example's
/// features hold 1 to 3 templates or none, drawn by its number (the same number, the same
/// templates), over chain A's residues alone, and none without template sampling.
/// `fastfold train` says it draws them; two runs of 2 steps repeat each other bit for bit
/// (losses and gradient norms), and the loss equals the run without templates, bit for bit,
/// until the first step that draws one, where it differs. A template flag that would do nothing is refused by name, and
/// `--template-mmcif-dir` without `--msas` too.
#[test]
fn a_complex_draws_templates_from_its_saved_hits() {
    let dir = common::scratch("train_complex", "templates");
    let (fasta, pdb, _, _) = complex(&dir, "hetero", &[QUERY, CHAIN]);
    let msas = dir.join("msas");
    saved_alignments(&msas, &[('A', QUERY), ('B', CHAIN)]);
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    std::fs::copy(fixtures.join("pdb_hits.hhr"), msas.join("A/pdb_hits.hhr")).unwrap();
    let mmcif = fixtures.join("mmcif");
    let sampling = TemplateSampling {
        max_templates: 4,
        mmcif_dir: mmcif.clone(),
        max_template_date: None,
        obsolete: Default::default(),
        kalign: None,
    };
    // Templates with an observed atom in example `number`, and the mask.
    let templates = |source: &ComplexSource, number: u64| -> (i64, Option<Tensor>) {
        let inputs = source.inputs((0, number), Device::Cpu).unwrap();
        let Some(mask) = inputs.template_all_atom_mask else { return (0, None) };
        let t = mask.size()[0];
        let real = mask.view([t, -1]).sum_dim_intlist(1, false, Kind::Float).gt(0.0).sum(Kind::Int64);
        let on_b = mask.sum_dim_intlist([0i64, 2].as_slice(), false, Kind::Float) * inputs.asym_id.eq(2);
        assert_eq!(on_b.sum(Kind::Float).double_value(&[]), 0.0, "example {number}: chain B has no hits");
        (real.int64_value(&[]), Some(mask))
    };
    let plain = ComplexSource::read(&fasta, Some(&msas), &pdb).unwrap();
    assert_eq!(templates(&plain, 1).0, 0, "no templates without sampling");
    let drawn = ComplexSource::read(&fasta, Some(&msas), &pdb).unwrap().with_templates(sampling, &msas).unwrap();
    assert_eq!(drawn.template_files(), [('A', vec![msas.join("A/pdb_hits.hhr")]), ('B', vec![])]);
    let mut counts = Vec::new();
    for number in 1..=6 {
        let (n, mask) = templates(&drawn, number);
        let (again, mask_again) = templates(&drawn, number);
        assert_eq!(n, again, "example {number} draws the same templates");
        assert!(mask.zip(mask_again).is_none_or(|(a, b)| a.equal(&b)), "example {number}: masks differ");
        counts.push(n);
    }
    eprintln!("templates per example: {counts:?}");
    assert!(counts.iter().all(|&n| n <= 3) && counts.iter().any(|&n| n >= 1), "{counts:?}");

    let (m, a) = (mmcif.display().to_string(), msas.display().to_string());
    let run = |name: &str, extra: &[&str]| {
        let mut args = words(&fasta, &pdb, &dir.join(name));
        let flags = ["--model-preset", "multimer", "--steps", "2", "--lr", "3e-3", "--max-recycles", "0", "--msas", &a];
        let flags = [&flags[..], &["--warmup", "0"]].concat();
        args.extend(flags.iter().chain(["--resolution", "2"].iter()).chain(extra).map(|s| s.to_string()));
        train(&args)
    };
    let (ok, text) = run("drawn", &["--template-mmcif-dir", &m]);
    assert!(ok, "{text}");
    assert!(text.contains("templates drawn per example") && text.contains("chain A: 1 hit files"), "{text}");
    let (ok, again) = run("again", &["--template-mmcif-dir", &m, "--quiet"]);
    assert!(ok, "{again}");
    let (ok, none) = run("none", &["--quiet"]);
    assert!(ok, "{none}");
    let (drawn_log, again_log, none_log) =
        (step_log(&dir.join("drawn")), step_log(&dir.join("again")), step_log(&dir.join("none")));
    assert_eq!(drawn_log.len(), 2);
    for (x, y) in drawn_log.iter().zip(&again_log) {
        for field in ["loss", "fape", "grad_norm"] {
            assert_eq!(x[field], y[field], "step {}: {field} of the same seed", x["step"]);
        }
    }
    let loss = |log: &[serde_json::Value]| log.iter().map(|s| s["loss"].as_f64().unwrap()).collect::<Vec<_>>();
    eprintln!("losses with templates {:?}, without {:?}", loss(&drawn_log), loss(&none_log));
    let first = counts[..2].iter().position(|&n| n >= 1).expect("one of the 2 steps draws a template");
    assert_ne!(drawn_log[first]["loss"], none_log[first]["loss"], "step {}: templates change nothing", first + 1);
    for step in 0..first {
        assert_eq!(drawn_log[step]["loss"], none_log[step]["loss"], "step {}: no template drawn", step + 1);
    }

    let (ok, text) = run("refused", &["--max-template-date", "2020-01-01"]);
    assert!(!ok && text.contains("--max-template-date") && text.contains("--template-mmcif-dir"), "{text}");
    let mut args = words(&fasta, &pdb, &dir.join("refused"));
    args.extend(["--model-preset", "multimer", "--template-mmcif-dir", &m].map(String::from));
    let (ok, text) = train(&args);
    assert!(!ok && text.contains("--msas"), "{text}");
    assert!(!dir.join("refused/params.npz").exists(), "parameters written");
}

/// A heterodimer whose chain A (the template fixtures' query) has hmmsearch's hits saved in its
/// `--msas` folder (`A/pdb_hits.sto`, the fixtures' hmmsearch result, as `predict
/// --template-searcher hmmsearch` saves it), a `pdb_hits.hhr` beside them: the `.sto` is read
/// (AlphaFold-Multimer's search), and over examples 1-8 every drawn hit is predict's
/// featurisation of the same hit, in the features' template slot it was drawn to, bit for bit;
/// the same number draws the same templates, and the draws differ between numbers.
#[test]
fn a_complex_draws_templates_from_its_hmmsearch_hits() {
    let dir = common::scratch("train_complex", "hmmsearch");
    let (fasta, pdb, _, _) = complex(&dir, "hetero", &[QUERY, CHAIN]);
    let msas = dir.join("msas");
    saved_alignments(&msas, &[('A', QUERY), ('B', CHAIN)]);
    let sto = msas.join("A/pdb_hits.sto");
    std::fs::copy(hmmsearch_fixture(), &sto).unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    std::fs::copy(fixtures.join("pdb_hits.hhr"), msas.join("A/pdb_hits.hhr")).unwrap();
    let mmcif = fixtures.join("mmcif");
    let sampling = template_sampling(&mmcif);
    let source = ComplexSource::read(&fasta, Some(&msas), &pdb).unwrap();
    let source = source.with_templates(sampling.clone(), &msas).unwrap();
    assert_eq!(source.template_files(), [('A', vec![sto.clone()]), ('B', vec![])], "the .sto, not the .hhr");
    // The complex has no release date: no date limit, in predict as in training.
    let predicted = predict_hmmsearch_features(&sto, QUERY, &mmcif, "9999-12-31");
    let hits = read_hits(std::slice::from_ref(&sto), QUERY, "", None).unwrap();
    let mut draws = Vec::new();
    for number in 1..=8 {
        // Chain A is the first entity: its draw is keyed (seed, number, 0).
        let drawn = sampling.draw(QUERY, &hits, (0, number, 0)).unwrap();
        let inputs = source.inputs((0, number), Device::Cpu).unwrap();
        let (positions, masks) = (inputs.template_all_atom_positions.unwrap(), inputs.template_all_atom_mask.unwrap());
        let names = check_drawn_as_predicted(&drawn, &predicted, Some((&positions, &masks)), 0);
        let t = masks.size()[0];
        let real = masks.view([t, -1]).sum_dim_intlist(1, false, Kind::Float).gt(0.0).sum(Kind::Int64);
        assert_eq!(real.int64_value(&[]), drawn.len() as i64, "example {number}: templates beyond those drawn");
        let again = source.inputs((0, number), Device::Cpu).unwrap();
        assert!(again.template_all_atom_positions.unwrap().equal(&positions), "example {number} draws anew");
        draws.push(names);
    }
    eprintln!(
        "predict's hits {:?}; drawn per example {draws:?}",
        predicted.iter().map(|h| &h.domain_name).collect::<Vec<_>>()
    );
    assert!(draws.iter().any(|d| !d.is_empty()), "no template drawn: {draws:?}");
    assert!(draws.iter().any(|d| d != &draws[0]), "every example drew the same: {draws:?}");
}

/// One complex draws each example's recycles as a data set does (`sample_recycles` of the seed
/// and the example's number, 0 to `--max-recycles`): `fastfold train --max-recycles 2` on the
/// homodimer cropped to 16 logs, for steps 1-6, the draws for examples 1-6, which vary; the
/// draw repeats for the same number and stays within 0..=max; `--max-recycles 0` draws none.
#[test]
fn one_complex_draws_its_recycles_per_example() {
    let draws = |seed: u64, max: usize| (1..=6).map(|n| sample_recycles(seed, n, max)).collect::<Vec<_>>();
    assert_eq!(draws(0, 2), draws(0, 2), "the same numbers draw the same");
    assert!(draws(0, 0).iter().all(|&r| r == 0));
    let wide: Vec<usize> = (1..=40).map(|n| sample_recycles(0, n, 3)).collect();
    assert!(wide.iter().all(|&r| r <= 3) && (0..=3).all(|r| wide.contains(&r)), "0..=3 over 40 examples: {wide:?}");
    let dir = common::scratch("train_complex", "recycles");
    let (fasta, pdb, _) = homodimer(&dir);
    let flags = ["--crop-size", "16", "--steps", "6", "--warmup", "0", "--max-recycles", "2", "--quiet"];
    let log = train_logged(&fasta, &pdb, &dir.join("out"), &flags);
    let logged: Vec<usize> = log.iter().map(|s| s["recycles"].as_u64().unwrap() as usize).collect();
    eprintln!("recycles logged for examples 1-6: {logged:?}");
    assert_eq!(logged, draws(0, 2), "step n trains example n with its drawn recycles");
    assert!(logged.iter().any(|&r| r != logged[0]), "the draws vary: {logged:?}");
    assert!(log.iter().all(|s| s["loss"].as_f64().is_some_and(f64::is_finite)), "{log:?}");
}

/// A heterodimer of 22 residues cropped to 16 (`--crop-size`): each example's features are
/// 16 of the truth's residues (types where the chain and number put them in the whole truth,
/// which the loss is given with the whole complex's chains), and 3 steps on the crops train with
/// every term finite; the same seed and example give the same crop; a crop that holds the
/// complex leaves it whole. A homodimer, whose copies are cropped differently, trains too
/// (`fastfold train --crop-size 16`, 2 steps logged).
#[test]
fn cropped_complexes_train_and_their_copies_align() {
    let dir = common::scratch("train_complex", "crop");
    let (fasta, pdb, _, _) = complex(&dir, "hetero", &[CHAIN, "GSWEDLKKLAE"]);
    let complex = TrainingComplex::read(&fasta, None, &pdb, 2.0, Some(16), Device::Cpu).unwrap();
    let params = load_multimer_params(&tiny_multimer()).unwrap();
    let mut trainer = Trainer::new(&params, Device::Cpu, &adam(3e-3)).unwrap();
    let exec = Exec::serial();
    let whole_types = complex.target.truth.aatype.shallow_clone();
    let mut kinds = Vec::new();
    for number in 1..=3 {
        let (inputs, target, kind) = complex.cropped(0, number).unwrap().expect("22 residues cropped to 16");
        let again = complex.cropped(0, number).unwrap().unwrap();
        assert!(again.0.residue_index.equal(&inputs.residue_index) && again.2 == kind, "example {number}");
        assert_eq!(inputs.residues().unwrap(), 16);
        assert_eq!(target.truth.aatype.size(), [22]);
        assert!(target.whole_chains.is_some() && target.resolution == 2.0);
        // Chain c's residue r is row 11 (c - 1) + r of the whole truth.
        let rows = (inputs.asym_id.to_kind(Kind::Int64) - 1) * 11 + inputs.residue_index.to_kind(Kind::Int64);
        let types = whole_types.index_select(0, &rows);
        assert!(types.equal(&inputs.aatype.to_kind(Kind::Int64)), "example {number}: residues differ");
        kinds.push(kind);
        trainer.begin_step(1).unwrap();
        let example = ComplexExample { features: &inputs, target: &target, recycles: 0, number };
        let losses = trainer.accumulate_complex(&example, &exec).unwrap();
        let (terms, norm) = trainer.finish_step(&exec).unwrap();
        assert!(losses.terms.loss.is_finite() && norm.is_finite() && norm > 0.0, "example {number}: {terms:?}");
    }
    eprintln!("crops {kinds:?}");
    assert!(kinds.iter().all(|k| *k != CropKind::Whole));
    let whole = TrainingComplex::read(&fasta, None, &pdb, 2.0, Some(22), Device::Cpu).unwrap();
    assert!(whole.cropped(0, 1).unwrap().is_none(), "a crop of 22 cut 22 residues");

    // A homodimer's copies cropped differently: the loss compares each with the same residues
    // of the true copy the alignment assigns it (`chain_permutation::align_crop`, whose own test
    // checks the assignment), and the run trains.
    let (dimer, dimer_pdb, _) = homodimer(&dir);
    let mut args = words(&dimer, &dimer_pdb, &dir.join("out"));
    args.extend(
        ["--model-preset", "multimer", "--crop-size", "16", "--steps", "2", "--max-recycles", "0"].map(String::from),
    );
    let (ok, text) = train(&args);
    assert!(ok, "{text}");
    assert_eq!(step_log(&dir.join("out")).len(), 2);
}

/// The gradients (every parameter's) and mean loss of one step on the homodimer cropped to 16
/// residues (each example its own crop and MSA sample) with `--dap dap` over `world`, every
/// rank training its group's share of the step's examples, equal one process's accumulating
/// them all (the step's examples numbered as `fastfold train` numbers them): within `tol` of
/// each array's largest gradient (arrays whose gradient is zero up to rounding, of the largest
/// overall / 1000), the loss within `tol / 10`. Returns the worst relative difference.
/// `dropout`: both train with dropout, and it changes the loss from one process's without.
/// `checkpointed`: the ranks recompute the stacks' blocks in backward (an array that gets no
/// gradient in one process gets none there either).
fn complex_on_ranks_gradients(
    world: &World,
    dap: usize,
    tol: f64,
    dropout: bool,
    checkpointed: bool,
) -> anyhow::Result<f64> {
    // Each rank writes its own copy of the files: no rank reads another's half-written ones.
    let dir = common::scratch("train_complex", &format!("ranks_{dap}_{dropout}_{}", world.rank()));
    let (fasta, pdb, _) = homodimer(&dir);
    let complex = TrainingComplex::read(&fasta, None, &pdb, 2.0, Some(16), Device::Cpu)?;
    let parallel = ParallelArgs { dap: Some(dap), accumulation: 1, global_batch: None, zero: 0 };
    let ranks = parallel.ranks(world)?;
    let params = load_multimer_params(&tiny_multimer())?;
    let grads =
        |t: &Trainer| -> Vec<(String, Tensor)> { t.params().iter().map(|(k, g)| (k.to_string(), g.grad())).collect() };
    // Trains `shard`'s examples of step 1 on `trainer` under `exec`: their mean loss over the
    // replicas, and each example's.
    let step = |trainer: &mut Trainer,
                shard: Shard,
                exec: &Exec,
                data: Option<&ProcessGroup>|
     -> anyhow::Result<(f64, Vec<f64>)> {
        trainer.begin_step(shard.accumulation as usize)?;
        let mut terms = Vec::new();
        for k in 0..shard.accumulation {
            let number = shard.example(1, k);
            let (features, target, _) = complex.cropped(0, number)?.context("22 residues cropped to 16")?;
            let example = ComplexExample { features: &features, target: &target, recycles: 1, number };
            terms.push(trainer.accumulate_complex(&example, exec)?.terms);
        }
        trainer.reduce_gradients(exec)?;
        Ok((mean_over_replicas(&terms, data)?.loss, terms.iter().map(|t| t.loss).collect()))
    };
    // One process accumulating every group's examples.
    let all = Shard { accumulation: ranks.shard.replicas * ranks.shard.accumulation, ..Shard::ONE };
    let mut one = Trainer::new(&params, Device::Cpu, &adam(1e-3))?.with_dropout(dropout);
    let (one_loss, each) = step(&mut one, all, &Exec::serial(), None)?;
    if dropout {
        let mut off = Trainer::new(&params, Device::Cpu, &adam(1e-3))?;
        let (off_loss, _) = step(&mut off, all, &Exec::serial(), None)?;
        eprintln!("loss with dropout {one_loss}, without {off_loss}");
        anyhow::ensure!((off_loss - one_loss).abs() > 1e-4, "dropout left the loss at {off_loss}");
    }
    // The examples differ (each its own crop or MSA sample, drawn from its number).
    anyhow::ensure!(each.windows(2).all(|w| w[0] != w[1]), "examples with the same loss: {each:?}");
    let reference = grads(&one);

    let mut trainer = Trainer::on_ranks(&params, Device::Cpu, &adam(1e-3), &ranks)?.with_dropout(dropout);
    let exec = Exec::new(ranks.dap.clone(), Some(3)).with_checkpointed_blocks(checkpointed);
    let (loss, _) = step(&mut trainer, ranks.shard, &exec, ranks.data.as_ref())?;
    let what = format!("--dap {dap} on {} ranks", world.size());
    anyhow::ensure!(
        (loss - one_loss).abs() <= tol / 10.0 * one_loss.abs(),
        "{what}: loss {loss}, one process {one_loss}"
    );
    let (worst, name, compared) = common::worst_gradient(&grads(&trainer), &reference).context(what.clone())?;
    eprintln!("{what}: loss {loss} (one process {one_loss}); worst gradient {worst:.2e} ({name}), {compared} compared");
    anyhow::ensure!(worst <= tol, "{what}: gradient of {name} differs by {worst:.2e} of its scale");
    anyhow::ensure!(compared > 100, "only {compared} gradients compared");
    Ok(worst)
}

// One DAP group of 2 ranks: the stacks split, their partial gradients summed; the blocks
// checkpointed.
dist_test!(a_complex_on_two_dap_ranks_gives_one_process_gradients, 2, |world| {
    complex_on_ranks_gradients(world, 2, 1e-4, false, true).map(|_| ())
});
// The same with dropout: every rank draws one process's masks (the loss is the same to the
// bit). The bound is 2e-4: the side-chain module's gradients, summed in another order over
// the ranks, come 1.05e-4 of their scale apart with dropout's scaled activations (2.6e-5
// without); a rank's mask other than one process's would move the loss.
dist_test!(a_complex_with_dropout_on_two_dap_ranks_gives_one_process_gradients, 2, |world| {
    complex_on_ranks_gradients(world, 2, 2e-4, true, false).map(|_| ())
});
// Two data-parallel replicas, each its own example (crop and MSA sample), the gradients
// averaged: one process accumulating both.
dist_test!(a_complex_on_two_replicas_gives_one_process_accumulating_gradients, 2, |world| {
    complex_on_ranks_gradients(world, 1, 1e-4, false, false).map(|_| ())
});
// Two groups of 2 DAP ranks (`--nproc 4 --dap 2`).
dist_test!(a_complex_on_two_dap_groups_of_two_gives_one_process_accumulating_gradients, 4, |world| {
    complex_on_ranks_gradients(world, 2, 1e-4, false, false).map(|_| ())
});

/// `fastfold train` on the homodimer cropped to 16 residues, one step of two examples (their
/// recycles drawn, `--max-recycles 1`, rank 0's logged as example 1's draw): one process accumulating both (`--accumulation 2`), one DAP group of 2 ranks doing the same
/// with the blocks checkpointed (`--nproc 2 --accumulation 2 --gradient-checkpointing`), two
/// replicas each training one (`--nproc 2 --dap 1`) and the latter under ZeRO-1 log the same
/// mean loss (within 1e-5 of it) and gradient norm (within 1e-4 of it; the gradients are the
/// same sums in another order); ZeRO-1 steps to the replicas' parameters (within 1e-6 of each
/// array's largest).
#[test]
fn train_command_splits_a_complex_over_dap_ranks_and_replicas() {
    let dir = common::scratch("train_complex", "command_ranks");
    let (fasta, pdb, _) = homodimer(&dir);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        // Each example's recycles are drawn from its number, whichever rank trains it.
        let flags = ["--crop-size", "16", "--steps", "1", "--warmup", "0", "--max-recycles", "1", "--quiet"];
        let log = train_logged(&fasta, &pdb, &out, &[&flags[..], extra].concat());
        assert_eq!(log.len(), 1, "{name}: {log:?}");
        assert_eq!(log[0]["recycles"], sample_recycles(0, 1, 1), "{name}: example 1's recycles");
        let value = |field: &str| log[0][field].as_f64().unwrap_or_else(|| panic!("{name}: no {field} in {log:?}"));
        (value("loss"), value("grad_norm"), out)
    };
    let (loss, norm, _) = run("one", &["--accumulation", "2"]);
    assert!(loss.is_finite() && norm.is_finite() && norm > 0.0, "loss {loss}, gradient norm {norm}");
    let mut params = Vec::new();
    for (name, flags) in [
        ("dap", &["--nproc", "2", "--accumulation", "2", "--gradient-checkpointing"][..]),
        ("replicas", &["--nproc", "2", "--dap", "1"]),
        ("zero", &["--nproc", "2", "--dap", "1", "--zero", "1"]),
    ] {
        let (l, n, out) = run(name, flags);
        eprintln!("{name}: loss {l} (one process {loss}), gradient norm {n} (one process {norm})");
        assert!((l - loss).abs() <= 1e-5 * loss.abs(), "{name}: mean loss {l}, one process {loss}");
        assert!((n - norm).abs() <= 1e-4 * norm, "{name}: gradient norm {n}, one process {norm}");
        params.push(load_multimer_params(&out.join("params-raw.npz")).unwrap());
    }
    for ((k, a), (_, b)) in params[2].iter().zip(params[1].iter()) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-6 * b.abs().max().double_value(&[]).max(1e-3), "--zero 1: {k} differs by {d:e}");
    }
}

/// `--precision bf16` on the homodimer at 2 Å (every head trained): the network's weights and
/// activations in bf16 with fp32 master weights, as for monomers: the first loss within 2% of
/// fp32's (its distogram term not equal to fp32's: the network ran in bf16), 5 steps lower it,
/// and the saved parameters are the fp32 masters (most arrays hold values bf16 cannot); under
/// DAP on 2 ranks the second loss is within 2% of one process's.
#[test]
fn a_complex_trains_in_bf16_with_fp32_masters() {
    let dir = common::scratch("train_complex", "bf16");
    let (fasta, pdb, _) = homodimer(&dir);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let flags = ["--lr", "3e-3", "--warmup", "0", "--ema-decay", "0", "--resolution", "2", "--max-recycles", "0"];
        let log = train_logged(&fasta, &pdb, &out, &[&flags[..], extra].concat());
        let loss: Vec<f64> = log.iter().map(|s| s["loss"].as_f64().unwrap()).collect();
        (loss, log[0]["distogram"].as_f64().unwrap(), out)
    };
    let (fp32, fp32_distogram, _) = run("fp32", &["--steps", "5"]);
    let (bf16, bf16_distogram, out) = run("bf16", &["--steps", "5", "--precision", "bf16"]);
    eprintln!("fp32 {fp32:?}\nbf16 {bf16:?}");
    let first = (bf16[0] - fp32[0]).abs() / fp32[0];
    assert!(first <= 0.02, "first loss {} in bf16, {} in fp32 ({first:.2e} apart)", bf16[0], fp32[0]);
    // The network did run in bf16: its logits, and so the distogram term, differ from fp32's.
    assert!(bf16_distogram != fp32_distogram, "the same distogram term {bf16_distogram} in bf16 and fp32");
    assert!(bf16[4] < bf16[0], "5 steps in bf16: loss {bf16:?}");
    // Under DAP on 2 ranks (the stacks' bf16 gradients summed over the ranks).
    let (two, _, _) = run("two", &["--steps", "2", "--precision", "bf16", "--nproc", "2"]);
    eprintln!("bf16 on 2 ranks {two:?}");
    let second = (two[1] - bf16[1]).abs() / bf16[1];
    assert!(second <= 0.02, "second loss {} on 2 ranks in bf16, {} on one ({second:.2e} apart)", two[1], bf16[1]);
    let saved = load_multimer_params(&out.join("params.npz")).unwrap();
    let finer = saved
        .iter()
        .filter(|(_, t)| t.kind() == Kind::Float && !t.to_kind(Kind::BFloat16).to_kind(Kind::Float).equal(t))
        .count();
    assert!(finer * 2 > saved.len(), "fp32 masters saved ({finer} of {} arrays finer than bf16)", saved.len());
}

//! Training on a tiny random model against a synthetic helix: gradients of the whole network
//! (embedders, stacks under DAP, structure module, heads) on 2 ranks equal one process's; the
//! `train` command lowers the loss, writes its log and parameters, and names a target that
//! does not fit the input; fine-tuning logs every term of the loss and lowers it; it trains
//! alike with the fused kernels; it trains on a data set in OpenFold's layout; DAP groups and
//! data-parallel replicas (`--dap`) give one process's gradients over the same examples; its
//! defaults are AlphaFold's optimiser recipe, the saved parameters are the weights' moving
//! average, a resumed run repeats the uninterrupted one, and it validates on held-out chains
//! with the moving average.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::dist::World;
use engine::job::{OptimizerArgs, OptimizerKind};
use engine::parallel::dap::Dap;
use fastfold::features::{process, FeatureConfig, Features, RawFeatures};
use fastfold::loss::clamped_fape_at;
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params};
use fastfold::pdb::Structure;
use fastfold::residue_constants::{aatype_of, atom_order};
use fastfold::train::{Example, Trainer};
use fastfold::train_target::Target;
use suite_tests::{dist_test, TestResult};
use tch::{Device, Kind, Tensor};

use common::BIN;
const SEQ: &str = "MKTAYIAKGRQISF";
const A3M: &str = ">query\nMKTAYIAKGRQISF\n>h1\nMKTAYLAKGRQISF\n>h2\nMRTAYIAK-RQISW\n>h3\nMKSAYIAKGRQLSF\n>h4\nAKTAYIPKGRQISF\n>h5\nMKTAY--KGRQISY\n";

fn dir(name: &str) -> suite_tests::Scratch {
    common::scratch("train", name)
}

/// An ideal-ish alpha helix (3.6 residues per turn, 1.5 Å rise) with N, CA, C, O and CB atoms.
fn helix(sequence: &str) -> Structure {
    let n = sequence.len();
    let mut positions = vec![[[0f32; 3]; 37]; n];
    let mut mask = vec![[0f32; 37]; n];
    for (i, c) in sequence.chars().enumerate() {
        let angle = i as f32 * 100f32.to_radians();
        let at = |r: f32, da: f32, dz: f32| [r * (angle + da).cos(), r * (angle + da).sin(), 1.5 * i as f32 + dz];
        let mut put = |name: &str, p: [f32; 3]| {
            let a = atom_order(name).unwrap();
            positions[i][a] = p;
            mask[i][a] = 1.0;
        };
        put("N", at(1.55, -0.28, -0.8));
        put("CA", at(2.3, 0.0, 0.0));
        put("C", at(1.65, 0.3, 0.9));
        put("O", at(1.9, 0.45, 2.0));
        if c != 'G' {
            put("CB", at(3.3, 0.1, -0.4));
        }
    }
    Structure {
        aatype: sequence.chars().map(aatype_of).collect(),
        residue_index: (0..n as i64).collect(),
        positions,
        mask,
        b_factors: vec![0.0; n],
    }
}

fn features(a3m_path: &Path) -> Features {
    std::fs::write(a3m_path, A3M).unwrap();
    let msa = data::a3m::read(a3m_path).unwrap();
    let raw = RawFeatures::new(SEQ, Some((&msa, a3m_path))).unwrap();
    let config = FeatureConfig { max_msa_clusters: 3, max_extra_msa: 4, num_recycle: 1, ..FeatureConfig::default() };
    process(&raw, &config, 3, Device::Cpu).unwrap()
}

/// Gradients of every parameter after one backward, by name (undefined where the loss does not
/// reach: the masked-MSA, lDDT, resolved and aligned-error heads), the Evoformer and extra-MSA
/// blocks checkpointed or not, with training dropout or not.
fn gradients(
    params: &Params,
    f: &Features,
    target: &Structure,
    dap: Dap,
    checkpointed: bool,
    dropout: bool,
) -> anyhow::Result<(f64, Vec<(String, Tensor)>)> {
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 1e-3,
        weight_decay: 0.0,
        clip_grad: Some(0.1),
        adam_epsilon: None,
    };
    let mut trainer = Trainer::new(params, Device::Cpu, &adam)?.with_dropout(dropout);
    let target = Target::new(target, &f.aatype.get(0), "helix")?;
    let losses = trainer.backward(f, &target, 1, &Exec::new(dap, Some(3)).with_checkpointed_blocks(checkpointed))?;
    let grads = trainer.params().iter().map(|(k, t)| (k.to_string(), t.grad())).collect();
    Ok((losses.total.double_value(&[]), grads))
}

/// `checkpointed`: the many-rank run's blocks are checkpointed (their recomputation in
/// backward repeats their collectives); `dropout`: both train with dropout (every rank draws
/// one process's masks).
fn compare(world: &World, checkpointed: bool, dropout: bool) -> TestResult {
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 11)?;
    let d = dir(match (checkpointed, dropout) {
        (_, true) => "dap-dropout",
        (true, false) => "dap-checkpointed",
        (false, false) => "dap",
    });
    let f = features(&d.join("q.a3m"));
    let target = helix(SEQ);
    let (loss_one, one) = gradients(&params, &f, &target, Dap::none(), false, dropout)?;
    let (loss_many, many) = gradients(&params, &f, &target, Dap::new(world.group.clone()), checkpointed, dropout)?;
    anyhow::ensure!((loss_one - loss_many).abs() <= 1e-5, "loss {loss_many} on 2 ranks, {loss_one} on one");
    let overall =
        one.iter().filter(|(_, g)| g.defined()).map(|(_, g)| g.abs().max().double_value(&[])).fold(0.0, f64::max);
    let mut compared = 0;
    for ((name, a), (_, b)) in many.iter().zip(&one) {
        anyhow::ensure!(a.defined() == b.defined(), "{name}: gradient defined on one side only");
        if !b.defined() {
            continue;
        }
        let scale = b.abs().max().double_value(&[]);
        let d = (a - b).abs().max().double_value(&[]);
        // rtol 1e-4 of the tensor's largest gradient; gradients that are zero up to rounding
        // (softmax-invariant offsets) are held to 1e-4 of the largest gradient overall.
        let tol = 1e-4 * scale.max(1e-3 * overall);
        anyhow::ensure!(d <= tol, "gradient of {name} differs by {d:e} (max |g| {scale:e}, tolerance {tol:e})");
        compared += 1;
    }
    anyhow::ensure!(compared > 100, "only {compared} gradients compared");
    Ok(())
}

dist_test!(two_ranks_give_one_rank_gradients, 2, |world| { compare(world, false, false) });
dist_test!(two_ranks_with_checkpointed_blocks_give_one_rank_gradients, 2, |world| { compare(world, true, false) });
dist_test!(two_ranks_with_dropout_give_one_rank_loss_and_gradients, 2, |world| { compare(world, true, true) });

/// With the Evoformer and extra-MSA blocks checkpointed (recomputed in backward), the loss is
/// the same bit for bit and every gradient within 1e-5 of its tensor's largest (the same
/// arithmetic, accumulated into `.grad` in another order).
#[test]
fn checkpointed_blocks_give_the_same_gradients() {
    checkpointed_blocks_equal_plain(false);
}

/// With dropout, the recomputation draws the masks of the first forward: the same loss and
/// gradients as without checkpointing.
#[test]
fn checkpointed_blocks_with_dropout_give_the_same_gradients() {
    checkpointed_blocks_equal_plain(true);
}

/// Dropout (on by default in `fastfold train`) changes the loss, and a run with the same seed
/// draws the same masks.
#[test]
fn dropout_changes_the_loss_and_repeats_with_the_seed() {
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 11).unwrap();
    let f = features(&dir("dropout").join("q.a3m"));
    let (on, _) = gradients(&params, &f, &helix(SEQ), Dap::none(), false, true).unwrap();
    let (again, _) = gradients(&params, &f, &helix(SEQ), Dap::none(), false, true).unwrap();
    let (off, _) = gradients(&params, &f, &helix(SEQ), Dap::none(), false, false).unwrap();
    eprintln!("loss with dropout {on}, again {again}, without {off}");
    assert_eq!(on, again, "the same seed and example draw the same masks");
    assert!((on - off).abs() > 1e-4, "dropout left the loss at {off} (with it {on})");
}

fn checkpointed_blocks_equal_plain(dropout: bool) {
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 11).unwrap();
    let f = features(&dir(if dropout { "checkpointed-dropout" } else { "checkpointed" }).join("q.a3m"));
    let (loss, plain) = gradients(&params, &f, &helix(SEQ), Dap::none(), false, dropout).unwrap();
    let (loss_ckpt, ckpt) = gradients(&params, &f, &helix(SEQ), Dap::none(), true, dropout).unwrap();
    assert_eq!(loss, loss_ckpt);
    let mut compared = 0;
    for ((name, a), (_, b)) in ckpt.iter().zip(&plain) {
        assert_eq!(a.defined(), b.defined(), "{name}: gradient defined on one side only");
        if b.defined() {
            let scale = b.abs().max().double_value(&[]).max(1e-12);
            let d = (a - b).abs().max().double_value(&[]);
            assert!(d <= 1e-5 * scale, "gradient of {name} differs by {d:e} (max |g| {scale:e})");
            compared += usize::from(name.contains("evoformer") || name.contains("extra_msa"));
        }
    }
    assert!(compared > 50, "only {compared} gradients of the stacks compared");
}

/// A target without the atoms of one loss term is an error, not a term that stays 0; one of
/// other residues names them.
#[test]
fn bad_targets_are_named() {
    // Without a glycine, whose pseudo-beta atom is its CA.
    let seq = SEQ.replace('G', "A");
    let aatype = Tensor::from_slice(&seq.chars().map(|c| aatype_of(c) as i64).collect::<Vec<_>>());
    let without = |atoms: &[&str]| {
        let mut s = helix(&seq);
        for m in &mut s.mask {
            for a in atoms {
                m[atom_order(a).unwrap()] = 0.0;
            }
        }
        Target::new(&s, &aatype, "t.pdb").err().map(|e| e.to_string())
    };
    assert_eq!(without(&[]), None, "the whole helix is a target");
    let err = without(&["N"]).expect("no N atoms");
    assert!(err.contains("t.pdb: no residue has the N, CA and C atoms"), "{err}");
    let err = without(&["CB"]).expect("no CB atoms");
    assert!(err.contains("t.pdb: no residue has the CB atom"), "{err}");
    let other = Tensor::from_slice(&seq.replacen('M', "W", 1).chars().map(|c| aatype_of(c) as i64).collect::<Vec<_>>());
    let err = Target::new(&helix(&seq), &other, "t.pdb").err().unwrap().to_string();
    assert!(err.contains("t.pdb: residue 1 is MET in the structure, TRP in the input"), "{err}");
    // A modified residue (SEP, read as X) matches the parent the input names.
    let mut modified = helix(&seq);
    modified.aatype[0] = fastfold::residue_constants::UNK_RESTYPE_INDEX;
    assert!(Target::new(&modified, &aatype, "t.pdb").is_ok());
}

/// With a moving average, the saved `params.npz` is the average of the weights' trajectory
/// (`e_0 = w_0`, `e_k = d e_(k-1) + (1 - d) w_k`, computed here in f64 from the weights after
/// each step) within 1e-6 of each array's largest value (the fp32 average's rounding), and
/// `params-raw.npz` is the weights as trained, bit for bit.
#[test]
fn saved_params_are_the_moving_average_of_the_trajectory() {
    let d = dir("ema");
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 15).unwrap();
    let f = features(&d.join("q.a3m"));
    let target = Target::new(&helix(SEQ), &f.aatype.get(0), "helix").unwrap();
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 3e-3,
        weight_decay: 0.0,
        clip_grad: Some(0.1),
        adam_epsilon: None,
    };
    let mut trainer = Trainer::new(&params, Device::Cpu, &adam).unwrap().with_ema(0.5).unwrap();
    let snapshot = |t: &Trainer| -> Vec<Tensor> { t.params().iter().map(|(_, a)| a.to_kind(Kind::Double)).collect() };
    let mut average = snapshot(&trainer);
    let exec = Exec::new(Dap::none(), Some(3));
    for number in 1..=3 {
        trainer.step(&[Example { features: &f, target: &target, recycles: 1, number }], &exec).unwrap();
        for (e, w) in average.iter_mut().zip(snapshot(&trainer)) {
            *e = &*e * 0.5 + w * 0.5;
        }
    }
    trainer.save(&d).unwrap();
    let saved = Params::load_model(d.join("params.npz")).unwrap();
    let raw = Params::load_model(d.join("params-raw.npz")).unwrap();
    assert_eq!(saved.len(), average.len());
    let mut apart = 0;
    for (((name, e), (_, r)), (want, now)) in saved.iter().zip(raw.iter()).zip(average.iter().zip(snapshot(&trainer))) {
        let scale = want.abs().max().double_value(&[]).max(1e-6);
        let diff = (e.to_kind(Kind::Double) - want).abs().max().double_value(&[]);
        assert!(diff <= 1e-6 * scale, "{name}: the average is off by {diff:e} (largest value {scale:e})");
        assert!(r.to_kind(Kind::Double).equal(&now), "{name}: params-raw.npz is not the trained weights");
        apart += usize::from(!e.equal(r));
    }
    assert!(
        apart * 2 > saved.len(),
        "the average differs from the weights in most arrays ({apart} of {})",
        saved.len()
    );
}

/// A data set's crop may fall where no atom was observed: it trains that step with finite
/// losses, the structure terms at 0 (`Target::of_crop`), where one example must have them.
#[test]
fn a_crop_without_observed_atoms_trains_with_its_structure_terms_at_zero() {
    let f = features(&dir("unobserved").join("q.a3m"));
    let mut empty = helix(SEQ);
    empty.mask.iter_mut().for_each(|m| *m = [0.0; 37]);
    let aatype = f.aatype.get(0);
    assert!(Target::new(&empty, &aatype, "crop").is_err());
    let target = Target::of_crop(&empty, &aatype, "crop").unwrap();
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 16).unwrap();
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 1e-3,
        weight_decay: 0.0,
        clip_grad: Some(0.1),
        adam_epsilon: None,
    };
    let mut trainer = Trainer::new(&params, Device::Cpu, &adam).unwrap();
    let example = Example { features: &f, target: &target, recycles: 1, number: 1 };
    let (t, norm) = trainer.step(&[example], &Exec::new(Dap::none(), None)).unwrap();
    let t = &t;
    assert!(t.loss.is_finite() && norm.is_finite(), "{t:?}");
    assert_eq!((t.fape, t.sidechain_fape, t.distogram), (0.0, 0.0, 0.0), "{t:?}");
    assert!(t.masked_msa > 0.0, "the MSA term still trains: {t:?}");
}

fn log(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("log.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// A training job's inputs written to `dir(name)`: the query, its MSA, the helix as its target
/// and a tiny random model.
struct Inputs {
    dir: suite_tests::Scratch,
    fasta: PathBuf,
    a3m: PathBuf,
    pdb: PathBuf,
    params: PathBuf,
}

impl Inputs {
    fn new(name: &str, seed: i64) -> Inputs {
        let dir = dir(name);
        let (fasta, a3m, pdb, params) =
            (dir.join("q.fasta"), dir.join("q.a3m"), dir.join("q.pdb"), dir.join("init.npz"));
        std::fs::write(&fasta, format!(">q\n{SEQ}\n")).unwrap();
        std::fs::write(&a3m, A3M).unwrap();
        helix(SEQ).write(&pdb).unwrap();
        Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), seed).unwrap().save(&params).unwrap();
        Inputs { dir, fasta, a3m, pdb, params }
    }

    /// `train`'s arguments naming them, writing to `out`.
    fn args(&self, out: &Path) -> Vec<String> {
        let path = |p: &Path| p.display().to_string();
        let mut args = vec![path(&self.fasta), "--msa".into(), path(&self.a3m), "--target".into(), path(&self.pdb)];
        args.extend(["--params".into(), path(&self.params), "-o".into(), path(out)]);
        args
    }
}

/// `--resume` continues a run as if it had not stopped: 2 steps, then 2 more from the
/// checkpoint, give the 4 steps' parameters (the average and the weights) bit for bit and the
/// same log, appended, not repeated, with the learning rate following the schedule across the
/// resume; on 2 ranks the resumed steps' losses are the same within rounding. Only the newest,
/// committed checkpoint is left; resuming with another seed, or where there is no checkpoint, is
/// an error naming it.
#[test]
fn a_resumed_run_repeats_the_uninterrupted_one() {
    let inputs = Inputs::new("resume", 16);
    let train = |out: &Path, extra: &[&str]| {
        let o = Command::new(BIN).arg("train").args(inputs.args(out)).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.success(), text)
    };
    // Warm-up over 1 step, then (as OpenFold counts) a quarter at step 3 and an eighth at 4.
    let recipe = ["--lr", "3e-3", "--warmup", "1", "--decay", "step", "--decay-after", "1", "--decay-every", "1"];
    let recipe = [&recipe[..], &["--decay-factor", "0.5", "--ema-decay", "0.5", "--save-every", "2"]].concat();
    let run = |out: &Path, extra: &[&str]| {
        let (ok, text) = train(out, &[&recipe[..], extra].concat());
        assert!(ok, "{text}");
        text
    };
    let straight = inputs.dir.join("straight");
    run(&straight, &["--steps", "4"]);
    let parted = inputs.dir.join("parted");
    run(&parted, &["--steps", "2"]);
    assert_eq!(log(&parted).len(), 2);
    let said = run(&parted, &["--steps", "4", "--resume"]);
    assert!(said.contains("resuming from") && said.contains("checkpoint-2 (step 2)"), "{said}");

    let (a, b) = (log(&straight), log(&parted));
    assert_eq!(b.iter().map(|s| s["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4], "appended once");
    for (x, y) in a.iter().zip(&b) {
        for (field, value) in x.as_object().unwrap() {
            if field != "seconds" && field != "peak_bytes" {
                assert_eq!(value, &y[field], "step {}: {field}", x["step"]);
            }
        }
    }
    let lrs: Vec<f64> = a.iter().map(|s| s["lr"].as_f64().unwrap()).collect();
    assert_eq!(lrs, [0.0, 3e-3, 3e-3 * 0.25, 3e-3 * 0.125]);
    for file in ["params.npz", "params-raw.npz"] {
        let (x, y) = (Params::load_model(straight.join(file)).unwrap(), Params::load_model(parted.join(file)).unwrap());
        for ((name, p), (_, q)) in x.iter().zip(y.iter()) {
            assert!(p.equal(q), "{file} {name}: the resumed run's differs");
        }
    }
    let mut names: Vec<String> =
        std::fs::read_dir(&parted).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["checkpoint-4", "latest", "log.jsonl", "params-raw.npz", "params.npz"]);
    let mut saved: Vec<String> = std::fs::read_dir(parted.join("checkpoint-4"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    saved.sort();
    assert_eq!(saved, ["state-rank0.safetensors", "trainer.json", "weights.npz"]);

    // On another number of ranks: DAP sums the stacks' gradients in another order, so the same
    // losses within 1e-5 of their size.
    let two = inputs.dir.join("two");
    run(&two, &["--steps", "2"]);
    run(&two, &["--steps", "4", "--resume", "--nproc", "2"]);
    for (x, y) in a.iter().zip(&log(&two)) {
        let (p, q) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!((p - q).abs() <= 1e-5 * p.abs(), "step {}: loss {q} resumed on 2 ranks, {p} on one", x["step"]);
    }
    assert_eq!(log(&two).len(), 4);

    let (ok, text) = train(&parted, &[&recipe[..], &["--steps", "6", "--resume", "--seed", "3"]].concat());
    assert!(!ok && text.contains("trained with --seed 0, this run has 3"), "{text}");
    let (ok, text) = train(&inputs.dir.join("none"), &["--steps", "2", "--resume"]);
    assert!(!ok && text.contains("no checkpoint to resume from") && text.contains("latest"), "{text}");
}

#[test]
fn train_command_lowers_the_loss_and_two_ranks_agree() {
    let inputs = Inputs::new("cli", 12);
    let (d, fasta, params) = (&inputs.dir, &inputs.fasta, &inputs.params);
    let train = |out: &Path, extra: &[&str]| {
        let o = Command::new(BIN).arg("train").args(inputs.args(out)).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.success(), text)
    };
    let one = d.join("one");
    let (ok, text) = train(
        &one,
        &["--steps", "8", "--lr", "3e-3", "--warmup", "0", "--report-to", "tensorboard", "--logging-dir", "tb"],
    );
    assert!(ok, "{text}");
    let steps = log(&one);
    assert_eq!(steps.len(), 8);
    // The same steps in TensorBoard, read by its own reader.
    let events = suite_tests::read_tensorboard(&one.join("tb/fastfold-train"));
    let tags = ["train/loss", "train/fape", "train/distogram", "train/grad_norm", "train/step_seconds", "train/lr"];
    for tag in tags.into_iter().chain(["train/peak_memory_gib"]) {
        assert_eq!(events.steps(tag), (1..=8).collect::<Vec<i64>>(), "{tag}: {events:?}");
    }
    for (field, tag) in [("loss", "train/loss"), ("fape", "train/fape"), ("grad_norm", "train/grad_norm")] {
        for (step, logged) in steps.iter().zip(events.values(tag)) {
            let want = step[field].as_f64().unwrap() as f32 as f64;
            assert!((want - logged).abs() <= 1e-6 * want.abs().max(1.0), "{tag} {logged}, log.jsonl {want}");
        }
    }
    let (first, last) = (steps[0]["loss"].as_f64().unwrap(), steps[7]["loss"].as_f64().unwrap());
    assert!(last < first, "8 Adam steps on one target: loss {first} -> {last}");
    let trained = Params::load_model(one.join("params-raw.npz")).unwrap();
    let average = Params::load_model(one.join("params.npz")).unwrap();
    assert!(trained.iter().zip(average.iter()).any(|((_, a), (_, b))| !a.equal(b)), "params.npz is the average");
    let initial = Params::load_model(params).unwrap();
    let moved = trained.iter().zip(initial.iter()).filter(|((_, a), (_, b))| !a.equal(b)).count();
    assert!(moved * 2 > trained.len(), "most arrays change ({moved} of {})", trained.len());

    // On 2 ranks with the blocks checkpointed, the same first loss.
    let two = d.join("two");
    let (ok, text) = train(&two, &["--steps", "1", "--lr", "3e-3", "--nproc", "2", "--gradient-checkpointing"]);
    assert!(ok, "{text}");
    let dap_first = log(&two)[0]["loss"].as_f64().unwrap();
    assert!((dap_first - first).abs() < 1e-5, "first loss {dap_first} on 2 ranks, {first} on one");

    let short = d.join("short.pdb");
    helix(&SEQ[..10]).write(&short).unwrap();
    let o = Command::new(BIN)
        .args([
            "train",
            fasta.to_str().unwrap(),
            "--target",
            short.to_str().unwrap(),
            "--params",
            params.to_str().unwrap(),
        ])
        .args(["-o", d.join("bad").to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("short.pdb") && err.contains("10 residues"), "{err}");
}

/// `--precision bf16`: the model's weights and activations in bf16 with fp32 master weights:
/// the first loss within 2% of fp32's (bf16 keeps 8 bits of mantissa through the network), a
/// few steps lower it, and the saved parameters and checkpoints are the fp32 masters (values bf16
/// cannot hold), so a resumed run repeats the uninterrupted one; under DAP and over data-parallel
/// replicas (with ZeRO-1 too) the losses stay within 2% of one process's.
#[test]
fn bf16_trains_with_fp32_masters() {
    let inputs = Inputs::new("bf16", 17);
    let train = |out: &Path, extra: &[&str]| {
        let o = Command::new(BIN).arg("train").args(inputs.args(out)).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        log(out).iter().map(|s| s["loss"].as_f64().unwrap()).collect::<Vec<_>>()
    };
    let flags = ["--lr", "3e-3", "--warmup", "0", "--ema-decay", "0"];
    let fp32 = train(&inputs.dir.join("fp32"), &[&flags[..], &["--steps", "6"]].concat());
    let out = inputs.dir.join("bf16");
    let bf16 = train(&out, &[&flags[..], &["--steps", "6", "--precision", "bf16"]].concat());
    assert!((bf16[0] - fp32[0]).abs() <= 0.02 * fp32[0], "first loss {} in bf16, {} in fp32", bf16[0], fp32[0]);
    assert!(bf16[5] < bf16[0], "6 steps in bf16: loss {bf16:?}");
    let saved = Params::load_model(out.join("params.npz")).unwrap();
    let finer = saved
        .iter()
        .filter(|(_, t)| t.kind() == Kind::Float && !t.to_kind(Kind::BFloat16).to_kind(Kind::Float).equal(t))
        .count();
    assert!(finer * 2 > saved.len(), "fp32 masters saved ({finer} of {} arrays finer than bf16)", saved.len());
    // Under DAP on 2 ranks (the stacks' bf16 gradients summed over the ranks).
    let two = train(
        &inputs.dir.join("two"),
        &[&flags[..], &["--steps", "2", "--precision", "bf16", "--nproc", "2"]].concat(),
    );
    assert!(
        (two[1] - bf16[1]).abs() <= 0.02 * bf16[1],
        "second loss {} on 2 ranks in bf16, {} on one",
        two[1],
        bf16[1]
    );
    // Two data-parallel replicas of the one example (their bf16 gradients averaged), with and
    // without ZeRO-1 (each steps its share of the masters, then they are gathered).
    for zero in ["0", "1"] {
        let extra = ["--steps", "2", "--precision", "bf16", "--nproc", "2", "--dap", "1", "--zero", zero];
        let replicas = train(&inputs.dir.join(format!("replicas-zero{zero}")), &[&flags[..], &extra].concat());
        assert!(
            (replicas[1] - bf16[1]).abs() <= 0.02 * bf16[1],
            "second loss {} on 2 replicas in bf16 (--zero {zero}), {} on one",
            replicas[1],
            bf16[1]
        );
    }
    // Checkpoints hold the masters: 3 steps, then 3 resumed, give the 6 steps' bit for bit.
    let parted = inputs.dir.join("parted");
    let bf16_flags = [&flags[..], &["--precision", "bf16", "--save-every", "3"]].concat();
    train(&parted, &[&bf16_flags[..], &["--steps", "3"]].concat());
    let resumed = train(&parted, &[&bf16_flags[..], &["--steps", "6", "--resume"]].concat());
    assert_eq!(resumed, bf16, "the losses of a resumed bf16 run");
    let again = Params::load_model(parted.join("params.npz")).unwrap();
    assert!(saved.iter().zip(again.iter()).all(|((_, a), (_, b))| a.equal(b)), "the resumed bf16 run's masters");
}

/// `fastfold train`'s defaults are AlphaFold's optimiser recipe: Adam at 1e-3 (epsilon 1e-6),
/// warm-up over 1000 steps, then 0.95 every 50,000 steps after 50,000, the gradient norm clipped
/// to 0.1, and the weights' moving average at 0.999.
#[test]
fn the_defaults_are_alphafolds_recipe() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: fastfold::train::TrainArgs,
    }
    let words = ["fastfold", "q.fasta", "--target", "q.pdb", "--params", "p.npz", "-o", "out"];
    let args = Cli::try_parse_from(words).unwrap().args;
    assert_eq!(
        (args.optimizer.optimizer, args.optimizer.lr, args.optimizer.weight_decay),
        (OptimizerKind::Adamw, 1e-3, 0.0)
    );
    assert_eq!((args.optimizer.clip_grad, args.ema_decay), (Some(0.1), 0.999));
    assert_eq!(args.optimizer.adam_epsilon, Some(1e-6));
    let s = args.schedule.schedule(args.optimizer.lr, 200_000).unwrap();
    assert_eq!(s.decay, engine::optim::Decay::Step { every: 50_000, factor: 0.95, after: 50_000 });
    assert_eq!((s.warmup, s.at(0), s.at(1000), s.at(50_000)), (1000, 0.0, 1e-3, 1e-3));
    assert!((s.at(50_001) - 0.95e-3).abs() < 1e-15 && (s.at(100_000) - 0.9025e-3).abs() < 1e-15);
}

/// `fastfold train --mmcif-dir --alignment-dir`: two steps on a layout of two chains, one
/// epoch, so each chain once (cropped, its recycling count drawn), finite losses in the log;
/// two DAP ranks train on the same first example to the same loss; a layout flag with
/// --target, or neither, is refused, and so are `--attention flash` and, on the CPU, `--gpu-mem`.
#[test]
fn train_command_trains_on_the_chains_of_a_layout() {
    let d = dir("layout");
    let (mmcif, alignments) = common::layout::write(&d, &["1abc_A", "3ghi_A"]);
    let params = d.join("init.npz");
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 15).unwrap().save(&params).unwrap();
    let out = d.join("out");
    let path = |p: &Path| p.display().to_string();
    let mut args = vec!["train".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
    args.extend([path(&alignments), "--params".into(), path(&params), "-o".into(), path(&out)]);
    let flags = ["--steps", "2", "--crop-size", "24", "--max-msa-clusters", "4", "--max-extra-msa", "8"];
    let o = Command::new(BIN).args(&args).args(flags).args(["--max-recycles", "1"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    assert!(text.contains("2 training chains in"), "{text}");
    let steps = log(&out);
    assert_eq!(steps.len(), 2);
    let mut chains = Vec::new();
    for s in &steps {
        assert!(s["loss"].as_f64().unwrap().is_finite() && s["fape"].as_f64().unwrap().is_finite(), "{s}");
        assert!(s["recycles"].as_u64().unwrap() <= 1, "{s}");
        assert!(s["data_seconds"].as_f64().unwrap() >= 0.0, "{s}");
        let example = s["example"].as_str().unwrap();
        let (chain, crop) = example.split_once(' ').unwrap();
        let (first, last) = crop.split_once('-').unwrap();
        let (first, last): (usize, usize) = (first.parse().unwrap(), last.parse().unwrap());
        assert_eq!(last + 1 - first, 24, "{example}: a crop of 24 residues");
        chains.push(chain.to_string());
    }
    chains.sort();
    assert_eq!(chains, ["1abc_A", "3ghi_A"], "one epoch visits each chain once");
    assert!(out.join("params.npz").exists());
    // Two DAP ranks are one replica: the same example, crop and loss as one process.
    let two = d.join("two");
    let mut args_two = args.clone();
    *args_two.last_mut().unwrap() = path(&two);
    let o =
        Command::new(BIN).args(&args_two).args(flags).args(["--max-recycles", "1", "--nproc", "2"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    let (one, dap) = (&steps[0], &log(&two)[0]);
    assert_eq!((&one["example"], &one["recycles"]), (&dap["example"], &dap["recycles"]));
    let (a, b) = (one["loss"].as_f64().unwrap(), dap["loss"].as_f64().unwrap());
    assert!((a - b).abs() <= 1e-5 * a.abs().max(1.0), "first loss {b} on 2 ranks, {a} on one");

    let o = Command::new(BIN).args(&args).args(["--target", "x.pdb"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--target") && err.contains("--mmcif-dir"), "{err}");
    let o = Command::new(BIN).args(["train", "--params", &path(&params), "-o", &path(&out)]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--target"), "{err}");
    let o = Command::new(BIN).args(&args).args(["--attention", "flash"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--attention flash is for predictions"), "{err}");
    // On the CPU --gpu-mem would change nothing: it is named, not ignored.
    let o = Command::new(BIN).args(&args).args(["--gpu-mem", "1G"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--gpu-mem caps a GPU's memory"), "{err}");
}

/// The gradients of one step on a layout's two chains with `--dap dap` over `world` (every
/// rank trains its group's share) in `kind` equal one process's accumulating both examples,
/// within `tol` of each parameter's largest gradient; the mean loss over the step's examples
/// too (within `tol / 10`).
fn data_parallel_gradients(world: &World, dap: usize, kind: Kind, tol: f64) -> TestResult {
    use clap::Parser;
    use fastfold::train_data::{layout, loader::ExampleLoader, loader::Shard};
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: fastfold::train::TrainArgs,
    }
    // Each rank writes its own copy of the layout: no rank reads another's half-written files.
    let d = dir(&format!("dp_gradients_{dap}_{}", world.rank()));
    let (mmcif, alignments) = common::layout::write(&d, &["1abc_A", "3ghi_A"]);
    let path = |p: &Path| p.display().to_string();
    let mut words = vec!["fastfold".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
    words.extend([path(&alignments), "--params".into(), "unused.npz".into(), "-o".into(), path(&d.join("out"))]);
    let flags = ["--crop-size", "24", "--max-msa-clusters", "4", "--max-extra-msa", "8", "--max-recycles", "1"];
    words.extend(flags.iter().map(|w| w.to_string()).chain(["--dap".into(), dap.to_string()]));
    let args = Cli::parse_from(words).args;
    let ranks = args.parallel.ranks(world)?;
    anyhow::ensure!(ranks.shard.replicas * dap as u64 == world.size() as u64, "{:?}", ranks.shard);
    let chains = layout::select(&mmcif, &alignments, &args.data.filters()?)?.chains;
    let pipeline = args.data.pipeline(args.config_preset, Some(4), Some(8), 0)?;
    let examples = |shard: Shard| -> anyhow::Result<Vec<_>> {
        let mut loader = ExampleLoader::new(chains.clone(), pipeline.clone(), args.data.chain_sampling, 1, shard, 1)?;
        (0..shard.accumulation)
            .map(|_| fastfold::train_target::layout_example(&loader.next_example()?, Device::Cpu))
            .collect()
    };
    fn batch(loaded: &[(Features, Target, usize, String)], shard: Shard) -> Vec<Example<'_>> {
        let number = |k: usize| shard.example(1, k as u64);
        loaded
            .iter()
            .enumerate()
            .map(|(k, (features, target, recycles, _))| Example {
                features,
                target,
                recycles: *recycles,
                number: number(k),
            })
            .collect()
    }
    let params = Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 17)?;
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 1e-3,
        weight_decay: 0.0,
        clip_grad: Some(0.1),
        adam_epsilon: None,
    };
    let grads =
        |t: &Trainer| -> Vec<(String, Tensor)> { t.params().iter().map(|(k, t)| (k.to_string(), t.grad())).collect() };

    let both = Shard { accumulation: 2, ..Shard::ONE };
    let loaded = examples(both)?;
    let mut one = Trainer::new_in(&params, Device::Cpu, kind, &adam)?;
    let one_losses = one.gradients(&batch(&loaded, both), &Exec::new(Dap::none(), Some(3)))?;
    let one_loss = one_losses.iter().map(|l| l.terms.loss).sum::<f64>() / 2.0;
    let reference = grads(&one);

    let mine = examples(ranks.shard)?;
    let mut trainer = Trainer::on_ranks_in(&params, Device::Cpu, kind, &adam, &ranks)?;
    let losses = trainer.gradients(&batch(&mine, ranks.shard), &Exec::new(ranks.dap.clone(), Some(3)))?;
    let terms: Vec<_> = losses.into_iter().map(|l| l.terms).collect();
    let mean = fastfold::train_parallel::mean_over_replicas(&terms, ranks.data.as_ref())?.loss;
    let loss_tol = tol / 10.0;
    anyhow::ensure!((mean - one_loss).abs() <= loss_tol * one_loss.abs(), "mean loss {mean}, one process {one_loss}");
    // `tol` of the tensor's largest gradient; gradients that are zero up to rounding
    // (softmax-invariant offsets) are held to `tol` of the largest gradient overall / 1000.
    let (worst, name, compared) = common::worst_gradient(&grads(&trainer), &reference)?;
    eprintln!("--dap {dap} on {} ranks: worst gradient {worst:.2e} ({name}), {compared} compared", world.size());
    anyhow::ensure!(worst <= tol, "gradient of {name} differs by {worst:.2e} of its scale");
    anyhow::ensure!(compared > 100, "only {compared} gradients compared");
    Ok(())
}

dist_test!(two_dap_groups_of_two_give_one_process_accumulating_gradients, 4, |world| {
    data_parallel_gradients(world, 2, Kind::Float, 1e-4)
});
dist_test!(two_replicas_give_one_process_accumulating_gradients, 2, |world| {
    data_parallel_gradients(world, 1, Kind::Float, 1e-4)
});
// In bf16 the replicas average their bf16 gradients where one process sums two examples'
// halves in bf16: here the same roundings (equal on this machine); allowed a few of bf16's
// 8-bit mantissa steps (2^-8), in case a backend sums in another order.
dist_test!(two_replicas_in_bf16_give_one_process_accumulating_gradients, 2, |world| {
    data_parallel_gradients(world, 1, Kind::BFloat16, 1e-2)
});

/// `fastfold train --nproc 4 --dap 2 --data DIR` (two groups of two DAP ranks), `--nproc 2 --dap 1` (two
/// replicas) and the latter with ZeRO-1 train one step on a layout's two chains as one process
/// accumulating both (`--accumulation 2`): rank 0 logs one of the two examples and the mean
/// loss of both; ZeRO-1 steps to the replicas' parameters. A --dap that does not divide
/// --nproc is refused, naming both.
#[test]
fn train_command_splits_a_step_over_dap_groups_and_replicas() {
    let d = dir("data_parallel");
    let (mmcif, alignments) = common::layout::write(&d, &["1abc_A", "3ghi_A"]);
    // The same layout as one --data folder: mmcif_files/ and alignments/.
    let dataset = d.join("dataset");
    std::fs::create_dir_all(&dataset).unwrap();
    std::os::unix::fs::symlink(&mmcif, dataset.join("mmcif_files")).unwrap();
    std::os::unix::fs::symlink(&alignments, dataset.join("alignments")).unwrap();
    let init = d.join("init.npz");
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 17).unwrap().save(&init).unwrap();
    let path = |p: &Path| p.display().to_string();
    let train = |name: &str, extra: &[&str]| {
        let out = d.join(name);
        let mut args = vec!["train".to_string()];
        if !extra.contains(&"--data") {
            args.extend(["--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into(), path(&alignments)]);
        }
        args.extend(["--params".into(), path(&init), "-o".into(), path(&out)]);
        let flags = ["--steps", "1", "--crop-size", "24", "--max-msa-clusters", "4", "--max-extra-msa", "8"];
        // At the peak learning rate from the first step, so that the step moves the weights.
        let flags = [&flags[..], &["--warmup", "0"]].concat();
        let o = Command::new(BIN).args(&args).args(flags).args(["--max-recycles", "1", "--quiet"]).args(extra).output();
        let o = o.unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.success(), text, out)
    };
    let (ok, text, out) = train("one", &["--accumulation", "2"]);
    assert!(ok, "{text}");
    let one = log(&out)[0].clone();
    let examples = one["example"].as_str().unwrap().to_string();
    assert_eq!(examples.matches("; ").count(), 1, "two examples in one step: {examples}");
    let mut params = Vec::new();
    for (name, flags) in [
        ("replicas", &["--nproc", "2", "--dap", "1"][..]),
        ("dap_groups", &["--nproc", "4", "--dap", "2", "--global-batch", "2", "--data", dataset.to_str().unwrap()]),
        ("zero", &["--nproc", "2", "--dap", "1", "--zero", "1"]),
    ] {
        let (ok, text, out) = train(name, flags);
        assert!(ok, "{name}: {text}");
        let step = &log(&out)[0];
        let mine = step["example"].as_str().unwrap();
        assert!(examples.split("; ").any(|e| e == mine), "{name}: rank 0 trained {mine}, one process {examples}");
        let (a, b) = (one["loss"].as_f64().unwrap(), step["loss"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{name}: mean loss {b}, one process {a}");
        params.push(Params::load_model(out.join("params-raw.npz")).unwrap());
    }
    for ((k, a), (_, b)) in params[2].iter().zip(params[0].iter()) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-6 * b.abs().max().double_value(&[]).max(1e-3), "--zero 1: {k} differs by {d:e}");
    }
    let (ok, text, _) = train("bad", &["--nproc", "3", "--dap", "2"]);
    assert!(!ok && text.contains("--dap 2 does not divide") && text.contains("--nproc 3"), "{text}");
    // A --data folder without alignments/ is named with what it must hold.
    let (ok, text, _) = train("no_alignments", &["--data", d.to_str().unwrap()]);
    assert!(!ok && text.contains("--data") && text.contains("mmcif_files"), "{text}");
}

/// `--resume` on a data set, two replicas under ZeRO-1: 2 steps, then 2 more from the
/// checkpoint (each rank wrote its shard of the optimizer's state), train the 4 steps' examples
/// to the same losses and weights, bit for bit, as the uninterrupted run: the loader starts at
/// the resumed step's examples.
#[test]
fn a_resumed_data_parallel_run_repeats_the_uninterrupted_one() {
    let d = dir("resume_layout");
    let (mmcif, alignments) = common::layout::write(&d, &["1abc_A", "3ghi_A"]);
    let init = d.join("init.npz");
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 18).unwrap().save(&init).unwrap();
    let path = |p: &Path| p.display().to_string();
    let train = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
        args.extend([path(&alignments), "--params".into(), path(&init), "-o".into(), path(out)]);
        let flags = ["--crop-size", "24", "--max-msa-clusters", "4", "--max-extra-msa", "8", "--max-recycles", "1"];
        let layout = ["--quiet", "--warmup", "0", "--nproc", "2", "--dap", "1", "--zero", "1", "--save-every", "2"];
        let o = Command::new(BIN).args(&args).args(flags).args(layout).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        log(out)
    };
    let straight = train(&d.join("straight"), &["--steps", "4"]);
    let parted = d.join("parted");
    train(&parted, &["--steps", "2"]);
    for rank in 0..2 {
        let file = parted.join(format!("checkpoint-2/state-rank{rank}.safetensors"));
        assert!(file.exists(), "{} missing: each rank writes its ZeRO shard", file.display());
    }
    let resumed = train(&parted, &["--steps", "4", "--resume"]);
    assert_eq!(resumed.len(), 4);
    for (a, b) in straight.iter().zip(&resumed) {
        for field in ["step", "example", "recycles", "loss", "grad_norm", "lr"] {
            assert_eq!(a[field], b[field], "step {}: {field}", a["step"]);
        }
    }
    let (a, b) =
        (Params::load_model(d.join("straight/params-raw.npz")), Params::load_model(parted.join("params-raw.npz")));
    for ((name, x), (_, y)) in a.unwrap().iter().zip(b.unwrap().iter()) {
        assert!(x.equal(y), "{name}: the resumed run's weights differ");
    }
}

/// `--config-preset finetuning` at a resolution inside the confidence heads' range: every
/// term in the log, the total their sum with the fine-tuning weights, backbone FAPE clamped in
/// the steps the seed draws (seed 2 leaves step 1 unclamped), and a few steps lower the total
/// (between steps clamped alike). Without `--resolution` the header's is read, and a target
/// without one trains no pLDDT.
#[test]
fn fine_tuning_logs_every_term_and_lowers_the_total() {
    let inputs = Inputs::new("finetune", 14);
    let train = |out: &Path, extra: &[&str]| {
        let o = Command::new(BIN).arg("train").args(inputs.args(out)).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        (log(out), text)
    };
    let flags = ["--steps", "6", "--lr", "3e-3", "--warmup", "0", "--config-preset", "finetuning", "--resolution", "2"];
    let flags = [&flags[..], &["--seed", "2"]].concat();
    let (steps, _) = train(&inputs.dir.join("fine"), &flags);
    assert!(steps.iter().all(|s| s["lr"] == 3e-3), "no warm-up, and the first decay at step 50,001");
    assert_eq!(steps.len(), 6);
    let term = |s: &serde_json::Value, name: &str| s[name].as_f64().unwrap_or_else(|| panic!("{name}: {s}"));
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["clamped"].as_bool(), Some(clamped_fape_at(2, i as u64 + 1, 0.9)), "step {}", i + 1);
        let weighted = [
            ("fape", 0.5),
            ("sidechain_fape", 0.5),
            ("chi", 0.5),
            ("angle_norm", 0.01),
            ("violation", 1.0),
            ("distogram", 0.3),
            ("masked_msa", 2.0),
            ("plddt", 0.01),
            ("experimentally_resolved", 0.01),
        ];
        let mut sum: f64 = weighted.iter().map(|&(name, w)| w * term(s, name)).sum();
        if let Some(pae) = s["aligned_error"].as_f64() {
            sum += 0.1 * pae;
        }
        // The log's values are f64 of fp32 terms: their sum within fp32 rounding.
        assert!((sum - term(s, "loss")).abs() <= 1e-5 * sum, "step {}: terms sum to {sum}, loss {s}", i + 1);
    }
    assert_eq!(steps[0]["clamped"].as_bool(), Some(false), "seed 2's first step is unclamped");
    for name in ["violation", "plddt", "experimentally_resolved", "masked_msa"] {
        assert!(term(&steps[0], name) > 0.0, "{name} is trained: {}", steps[0]);
    }
    let (first, last) = (term(&steps[1], "loss"), term(&steps[5], "loss"));
    assert!(steps[1..6].iter().all(|s| s["clamped"] == true), "steps 2-6 clamped alike");
    assert!(last < first, "4 Adam steps of fine-tuning: loss {first} -> {last}");

    // The resolution from the header; without one, no pLDDT.
    let text = std::fs::read_to_string(&inputs.pdb).unwrap();
    std::fs::write(&inputs.pdb, format!("REMARK   2 RESOLUTION.    1.90 ANGSTROMS.\n{text}")).unwrap();
    let (header, _) = train(&inputs.dir.join("header"), &["--steps", "1"]);
    assert!(term(&header[0], "plddt") > 0.0, "{}", header[0]);
    std::fs::write(&inputs.pdb, text).unwrap();
    let (none, said) = train(&inputs.dir.join("none"), &["--steps", "1"]);
    assert_eq!(term(&none[0], "plddt"), 0.0, "{}", none[0]);
    assert!(said.contains("no resolution in its header"), "{said}");
}

/// `fastfold train --kernels fused` (the stacks' fused kernels and the installed fused optimizer
/// steps) trains as `--kernels torch` does: on a GPU, else on the CPU emulator (a failure under
/// SUITE_REQUIRE_CUDA=1; scripts/gpu-check.sh runs it there).
#[test]
fn training_with_fused_kernels_equals_the_compositions_on_cuda_or_the_emulator() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: fastfold::train::TrainArgs,
    }
    let dev = suite_tests::cuda_or_emulator(
        "training_with_fused_kernels_equals_the_compositions_on_cuda_or_the_emulator",
        kernels::emulator::enable,
    );
    let inputs = Inputs::new("kernels", 13);
    let world = World::single(&engine::dist::InitOptions { timeout: suite_tests::TEST_TIMEOUT }).unwrap();
    let train = |backend: &str| {
        let out = inputs.dir.join(backend);
        let device = if dev.is_cuda() { "cuda" } else { "cpu" };
        let flags = ["fastfold", "--quiet", "--steps", "2", "--lr", "3e-3", "--warmup", "0", "--device", device];
        let flags = [&flags[..], &["--kernels", backend]].concat();
        let words = flags.iter().map(|w| w.to_string()).chain(inputs.args(&out));
        let log = fastfold::train::run(&Cli::parse_from(words).args, &world).unwrap();
        (log, Params::load_model(out.join("params-raw.npz")).unwrap())
    };
    let (torch_log, torch) = train("torch");
    assert!(engine::optim::fused::installed().is_none(), "--kernels torch installs no optimizer steps");
    let (fused_log, fused) = train("fused");
    assert!(engine::optim::fused::installed().is_some(), "--kernels fused installs the optimizer steps");
    engine::optim::fused::install(None);
    for (a, b) in fused_log.iter().zip(&torch_log) {
        assert!(
            (a.losses.loss - b.losses.loss).abs() <= 1e-4 * b.losses.loss.abs(),
            "step {}: loss {} fused, {} torch",
            a.step,
            a.losses.loss,
            b.losses.loss
        );
    }
    let mut worst = (0.0, String::new());
    for ((name, a), (_, b)) in fused.iter().zip(torch.iter()) {
        let d = (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-6);
        if d > worst.0 {
            worst = (d, name.to_string());
        }
    }
    // Measured on the emulator: 3.4e-6 (a LayerNorm offset); f32 sums in another order, through
    // Adam's division by the gradients' running scale.
    assert!(worst.0 <= 1e-4, "{}: differs by {:.3e} of its largest value", worst.1, worst.0);
    // The fused optimizer steps sum in another order and leave some trace: parameters
    // bit-identical to torch's would mean that they never ran. (The tiny model's forward can
    // match torch's bit for bit: its first loss did here.)
    assert!(worst.0 > 0.0, "--kernels fused gave torch's parameters bit for bit");
}

/// `fastfold train --val-mmcif-dir --val-alignment-dir --val-every 1`: each step's record
/// holds the validation on the held-out chain (lDDT-Cα in [0, 1], finite losses); the same
/// weights (learning rate 0) validate alike twice; with a moving average the validation
/// evaluates it (not the weights as trained, which a run without one validates); two DAP
/// ranks, and two replicas, validate as one process; an empty validation folder is refused.
#[test]
fn train_command_validates_on_held_out_chains_with_the_average() {
    let d = dir("validation");
    let (mmcif, alignments) = common::layout::write(&d.join("train"), &["1abc_A"]);
    let (val_mmcif, val_alignments) = common::layout::write(&d.join("val"), &["3ghi_A", "2def_A"]);
    let params = d.join("init.npz");
    Params::random_model(&EvoformerConfig::tiny(), &ModelConfig::tiny(), 15).unwrap().save(&params).unwrap();
    let path = |p: &Path| p.display().to_string();
    let run = |name: &str, extra: &[&str]| -> Vec<serde_json::Value> {
        let out = d.join(name);
        let mut args = vec!["train".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
        args.extend([path(&alignments), "--params".into(), path(&params), "-o".into(), path(&out)]);
        args.extend(["--val-mmcif-dir".into(), path(&val_mmcif), "--val-alignment-dir".into(), path(&val_alignments)]);
        let flags = ["--crop-size", "24", "--max-msa-clusters", "4", "--max-extra-msa", "8", "--max-recycles", "1"];
        let fast = ["--val-every", "1", "--val-recycles", "1", "--val-max-chains", "1"];
        let o = Command::new(BIN).args(&args).args(flags).args(fast).args(extra).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{text}");
        log(&out)
    };
    let val = |s: &serde_json::Value, key: &str| s[key].as_f64().unwrap_or_else(|| panic!("no {key} in {s}"));

    // Warm-up from 0: the step leaves the weights as they were (the initial ones).
    let fixed = run("fixed", &["--steps", "1", "--warmup", "2", "--ema-decay", "0"]);
    let again = run("again", &["--steps", "1", "--warmup", "2", "--ema-decay", "0"]);
    for s in fixed.iter().chain(&again) {
        assert_eq!(s["val_chains"].as_u64(), Some(1), "--val-max-chains 1: {s}");
        let lddt = val(s, "val_lddt_ca");
        assert!((0.0..=1.0).contains(&lddt), "{s}");
        for key in ["val_loss", "val_fape", "val_distogram", "val_masked_msa", "val_plddt"] {
            assert!(val(s, key).is_finite(), "{key}: {s}");
        }
    }
    for key in ["val_lddt_ca", "val_loss", "val_fape", "val_distogram"] {
        assert_eq!(val(&fixed[0], key), val(&again[0], key), "{key}: the same weights, the same validation");
    }

    let raw = run("raw", &["--steps", "2", "--warmup", "0", "--lr", "1e-2", "--ema-decay", "0"]);
    let average = run("average", &["--steps", "2", "--warmup", "0", "--lr", "1e-2", "--ema-decay", "0.5"]);
    assert_eq!((raw.len(), average.len()), (2, 2), "--val-every 1: a validation after each step");
    assert_eq!(val(&raw[1], "loss"), val(&average[1], "loss"), "the same training steps");
    let (r, a, init) = (val(&raw[1], "val_loss"), val(&average[1], "val_loss"), val(&fixed[0], "val_loss"));
    assert!(
        r != a && a != init,
        "the average (loss {a}) is neither the trained weights ({r}) nor the initial ({init})"
    );

    let dap = run("dap", &["--steps", "1", "--warmup", "0", "--lr", "1e-2", "--ema-decay", "0.5", "--nproc", "2"]);
    let (one, two) = (val(&average[0], "val_loss"), val(&dap[0], "val_loss"));
    assert!((one - two).abs() <= 1e-4 * one.abs().max(1.0), "validation loss {two} on 2 ranks, {one} on one");
    assert!((val(&average[0], "val_lddt_ca") - val(&dap[0], "val_lddt_ca")).abs() <= 1e-4);
    // Two replicas each validate every chain: as one process accumulating their examples.
    let batch = ["--steps", "1", "--warmup", "0", "--lr", "1e-2", "--ema-decay", "0.5", "--global-batch", "2"];
    let one = run("accumulated", &batch);
    let replicas = run("replicas", &[&batch[..], &["--nproc", "2", "--dap", "1"]].concat());
    let (a, b) = (val(&one[0], "val_loss"), val(&replicas[0], "val_loss"));
    assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "validation loss {b} on 2 replicas, {a} on one process");

    // A validation folder without chains is refused, naming its flag; so is --val-every alone.
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let mut args = vec!["train".to_string(), "--mmcif-dir".into(), path(&mmcif), "--alignment-dir".into()];
    args.extend([path(&alignments), "--params".into(), path(&params), "-o".into(), path(&d.join("bad"))]);
    let o = Command::new(BIN)
        .args(&args)
        .args(["--val-mmcif-dir", &path(&val_mmcif), "--val-alignment-dir", &path(&empty)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--val-alignment-dir"), "{err}");
    let o = Command::new(BIN).args(&args).args(["--val-every", "2"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--val-mmcif-dir"), "{err}");
}

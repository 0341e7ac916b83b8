//! Templates: AlphaFold's torsion angles against dihedrals computed independently, the template
//! parameters' names and shapes (inferred back, stray arrays named), template features read
//! from `.npz`, and the model: padding template slots change nothing, real ones change the
//! prediction.
use fastfold::features::{process, FeatureConfig, Features, RawFeatures, TemplateFeatures};
use fastfold::model::alphafold::AlphaFold;
use fastfold::model::pair_rows::PairRows;
use fastfold::model::templates::{pair_features, torsion_angles, PAIR_FEATURES};
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params, TemplateConfig};
use fastfold::residue_constants::{aatype_of, atom_order};
use tch::{Device, Kind, Tensor};

const F: (Kind, Device) = (Kind::Float, Device::Cpu);
const SEQ: &str = "MRFKGS";

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("fastfold-templates", name)
}

/// Standard dihedral angle of four points (radians), by the cross-product formula.
fn dihedral(p: [[f64; 3]; 4]) -> f64 {
    let sub = |a: [f64; 3], b: [f64; 3]| [a[0] - b[0], a[1] - b[1], a[2] - b[2]];
    let cross =
        |a: [f64; 3], b: [f64; 3]| [a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0]];
    let dot = |a: [f64; 3], b: [f64; 3]| a[0] * b[0] + a[1] * b[1] + a[2] * b[2];
    let (b1, b2, b3) = (sub(p[1], p[0]), sub(p[2], p[1]), sub(p[3], p[2]));
    let (n1, n2) = (cross(b1, b2), cross(b2, b3));
    (dot(b2, b2).sqrt() * dot(b1, n2)).atan2(dot(n1, n2))
}

/// Random atom positions for every atom of the sequence's residues (all present).
fn random_structure(seed: i64) -> (Tensor, Tensor, Tensor) {
    let g = seed as f64;
    let n = SEQ.len() as i64;
    // A deterministic pseudo-random cloud (no global generator: tests run in parallel).
    let values: Vec<f32> =
        (0..n * 37 * 3).map(|i| ((i as f64 * 12.9898 + g).sin() * 43758.5453).fract() as f32 * 6.0).collect();
    let base: Vec<f32> = (0..n * 37 * 3).map(|i| (i / (37 * 3)) as f32 * 3.8 * ((i % 3 == 0) as i32) as f32).collect();
    let pos = (Tensor::from_slice(&values) + Tensor::from_slice(&base)).reshape([1, n, 37, 3]);
    let aatype = Tensor::from_slice(&SEQ.chars().map(|c| aatype_of(c) as i64).collect::<Vec<_>>()).reshape([1, n]);
    let mask = Tensor::ones([1, n, 37], F);
    (aatype, pos, mask)
}

fn point(pos: &Tensor, r: i64, atom: &str) -> [f64; 3] {
    let a = atom_order(atom).unwrap() as i64;
    let v = Vec::<f64>::try_from(pos.get(0).get(r).get(a).to_kind(Kind::Double)).unwrap();
    [v[0], v[1], v[2]]
}

#[test]
fn torsion_angles_are_the_dihedrals_of_their_atoms() {
    let (aatype, pos, mask) = random_structure(3);
    let (sin_cos, alt, tmask) = torsion_angles(&aatype, &pos, &mask).unwrap();
    assert_eq!(sin_cos.size(), [1, SEQ.len() as i64, 7, 2]);
    let check = |r: i64, k: i64, angle: f64, what: &str| {
        let got = Vec::<f64>::try_from(sin_cos.get(0).get(r).get(k).to_kind(Kind::Double)).unwrap();
        assert!(
            (got[0] - angle.sin()).abs() < 1e-4 && (got[1] - angle.cos()).abs() < 1e-4,
            "residue {r} {what}: (sin, cos) {got:?}, dihedral {angle}"
        );
    };
    for r in 1..SEQ.len() as i64 {
        let p = |res: i64, a: &str| point(&pos, res, a);
        check(r, 0, dihedral([p(r - 1, "CA"), p(r - 1, "C"), p(r, "N"), p(r, "CA")]), "omega");
        check(r, 1, dihedral([p(r - 1, "C"), p(r, "N"), p(r, "CA"), p(r, "C")]), "phi");
        // AlphaFold takes psi through O and turns it by pi.
        check(r, 2, dihedral([p(r, "N"), p(r, "CA"), p(r, "C"), p(r, "O")]) + std::f64::consts::PI, "psi");
    }
    // M R F K: chi1 N-CA-CB-CG; R chi4 CG-CD-NE-CZ; F chi2 CA-CB-CG-CD1 (pi-periodic).
    let p = |res: i64, a: &str| point(&pos, res, a);
    check(0, 3, dihedral([p(0, "N"), p(0, "CA"), p(0, "CB"), p(0, "CG")]), "MET chi1");
    check(1, 6, dihedral([p(1, "CG"), p(1, "CD"), p(1, "NE"), p(1, "CZ")]), "ARG chi4");
    check(2, 4, dihedral([p(2, "CA"), p(2, "CB"), p(2, "CG"), p(2, "CD1")]), "PHE chi2");
    let phe_chi2 = sin_cos.get(0).get(2).get(4);
    assert!(alt.get(0).get(2).get(4).equal(&(-&phe_chi2)), "PHE chi2's alternative is turned by pi");
    assert!(alt.get(0).get(1).get(6).equal(&sin_cos.get(0).get(1).get(6)), "ARG chi4 is not pi-periodic");
    let m = Vec::<f32>::try_from(tmask.get(0).flatten(0, -1)).unwrap();
    // Residue 0 has no omega or phi; MET has 3 chis, ARG 4, PHE 2, LYS 4, GLY 0, SER 1.
    let expected_chis = [3, 4, 2, 4, 0, 1];
    for (r, chis) in expected_chis.iter().enumerate() {
        let row = &m[r * 7..r * 7 + 7];
        assert_eq!(row[0] == 1.0, r > 0, "omega mask of residue {r}");
        assert_eq!(row[1] == 1.0, r > 0, "phi mask of residue {r}");
        assert_eq!(row[2], 1.0, "psi mask of residue {r}");
        assert_eq!(row[3..].iter().filter(|&&v| v == 1.0).count(), *chis, "chi masks of residue {r}");
    }
}

/// Template features of one template (a random structure) for `r` recycling slices: a real
/// one, or (`real` false) a padding slot as AlphaFold's pipeline fills it, every mask zero.
fn templates(real: bool, r: i64) -> TemplateFeatures {
    let (aatype, pos, mask) = random_structure(5);
    let real = if real { 1.0 } else { 0.0 };
    let mask = mask * real;
    let n = SEQ.len() as i64;
    let cb = atom_order("CB").unwrap() as i64;
    let pb = pos.select(2, cb);
    let t = TemplateFeatures {
        aatype,
        all_atom_positions: pos,
        all_atom_masks: mask,
        mask: Tensor::full([1], real, F),
        pseudo_beta: pb,
        pseudo_beta_mask: Tensor::ones([1, n], F) * real,
    };
    t.map(|x| x.unsqueeze(0).expand([&[r][..], &x.size()[..]].concat(), false).contiguous())
}

fn template_params() -> Params {
    let model = ModelConfig { templates: Some(TemplateConfig::tiny()), ..ModelConfig::tiny() };
    Params::random_model(&EvoformerConfig::tiny(), &model, 17).unwrap()
}

#[test]
fn template_parameters_round_trip_and_stray_arrays_are_named() {
    let d = scratch("params");
    let path = d.join("p.npz");
    template_params().save(&path).unwrap();
    let loaded = Params::load_model(&path).unwrap();
    assert_eq!(loaded.model_config().unwrap().templates, Some(TemplateConfig::tiny()));
    let key =
        "alphafold/alphafold_iteration/evoformer/template_embedding/single_template_embedding/embedding2d//weights";
    assert_eq!(loaded.get(key).unwrap().size(), [PAIR_FEATURES, TemplateConfig::tiny().c_t]);

    let mut arrays: Vec<(String, Tensor)> = Tensor::read_npz(&path).unwrap();
    arrays.push((
        "alphafold/alphafold_iteration/evoformer/template_embedding/stray//weights".into(),
        Tensor::zeros([2], F),
    ));
    let stray = d.join("stray.npz");
    data::checkpoint::save_npz(&arrays, &stray).unwrap();
    let err = Params::load_model(&stray).err().unwrap().to_string();
    assert!(err.contains("template_embedding/stray//weights") && err.contains("stray.npz"), "{err}");

    // Without the array that marks a template embedding, its other arrays have no user: an
    // error naming them, not a model that drops its templates silently.
    let arrays: Vec<(String, Tensor)> =
        Tensor::read_npz(&path).unwrap().into_iter().filter(|(k, _)| k != key).collect();
    let partial = d.join("partial.npz");
    data::checkpoint::save_npz(&arrays, &partial).unwrap();
    let err = Params::load_model(&partial).err().unwrap().to_string();
    assert!(
        err.contains("partial.npz") && err.contains("no module uses") && err.contains("template_embedding/"),
        "{err}"
    );
}

/// Largest difference of the inference path's template update from the stacked one,
/// relative to the update's largest magnitude: the online softmax sums the same terms in
/// another order (fp32).
const ONLINE_TOLERANCE: f64 = 1e-5;

/// The inference path's template update (each template folded into an online softmax over
/// the templates as it leaves the pair stack, never the stack [T, N, N, c_t]) equals the
/// stacked path's (every template's stack, one softmax over it, as training runs it) within
/// [`ONLINE_TOLERANCE`]: three templates over 7 residues (the last masked in the pair mask),
/// a padding slot (template mask 0, every atom mask 0, as the pipeline pads) first, in the
/// middle, last, or none, the pair's rows whole and 2 at a time; with every slot padding the
/// pair is left as it was, exactly.
#[test]
fn online_template_softmax_equals_the_stacked_one() {
    use engine::parallel::dap::Dap;
    use fastfold::model::layers::Stream;
    use fastfold::model::templates::Templates;

    let templates = Templates::new(&template_params()).unwrap().expect("templates");
    tch::manual_seed(11);
    let (n, count) = (7, 3);
    let pair = Tensor::randn([n, n, EvoformerConfig::tiny().c_z], F);
    let seq_mask = Tensor::from_slice(&[1f32, 1., 1., 1., 1., 1., 0.]);
    let pair_mask = seq_mask.unsqueeze(1) * seq_mask.unsqueeze(0);
    let positions = Tensor::rand([count, n, 37, 3], F) * 20.0;
    let mut worst: f64 = 0.0;
    for real in [[1f32, 1., 1.], [0., 1., 1.], [1., 0., 1.], [1., 1., 0.], [0., 0., 0.]] {
        let mask = Tensor::from_slice(&real);
        let t = TemplateFeatures {
            aatype: Tensor::randint(20, [count, n], (Kind::Int64, Device::Cpu)),
            all_atom_positions: &positions * mask.view([count, 1, 1, 1]),
            all_atom_masks: Tensor::ones([count, n, 37], F) * mask.view([count, 1, 1]),
            pseudo_beta: positions.select(2, 3) * mask.view([count, 1, 1]),
            pseudo_beta_mask: Tensor::ones([count, n], F) * mask.view([count, 1]),
            mask: mask.shallow_clone(),
        };
        for chunk in [None, Some(2)] {
            let exec = Exec::new(Dap::none(), chunk);
            let stacked = templates.pair_update(&pair, &t, &pair_mask, &exec).unwrap();
            let mut stream = Stream::new(pair.copy(), true);
            tch::no_grad(|| templates.add_pair_update(&mut stream, &t, &pair_mask, &exec, None, &PairRows::whole(n)))
                .unwrap();
            let online = stream.into_inner();
            if real == [0., 0., 0.] {
                assert!(online.equal(&pair), "all padding, chunk {chunk:?}: the pair changed");
                continue;
            }
            // Both updates added to the same pair, rounded alike.
            let scale = stacked.abs().max().double_value(&[]);
            let err = (&online - (&pair + &stacked)).abs().max().double_value(&[]) / scale;
            eprintln!(
                "template mask {real:?}, chunk {chunk:?}: relative difference {err:.2e} (update up to {scale:.3})"
            );
            assert!(err <= ONLINE_TOLERANCE, "template mask {real:?}, chunk {chunk:?}: {err:e} from the stacked path");
            worst = worst.max(err);
        }
    }
    eprintln!("largest relative difference {worst:.2e}");
}

fn features_with(t: Option<TemplateFeatures>) -> Features {
    let raw = RawFeatures::new(SEQ, None).unwrap();
    let config = FeatureConfig { num_recycle: 1, ..FeatureConfig::default() };
    let mut f = process(&raw, &config, 0, Device::Cpu).unwrap();
    f.templates = t;
    f
}

#[test]
fn padding_templates_change_nothing_and_real_ones_do() {
    let params = template_params();
    let model = AlphaFold::new(&params).unwrap();
    let run = |f: &Features| tch::no_grad(|| model.predict(f, 1, Kind::Float, &Exec::serial(), None)).unwrap();
    let none = run(&features_with(None));
    let masked = run(&features_with(Some(templates(false, 2))));
    let real = run(&features_with(Some(templates(true, 2))));
    let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    // fp32: padding slots add masked MSA rows (their softmax weights and sums are exact
    // zeros, but reductions run over more rows in another order) and a zero pair update;
    // observed 3e-5 on distogram logits of magnitude ~10.
    for (what, a, b) in [
        ("distogram", &masked.heads.distogram, &none.heads.distogram),
        ("pair", &masked.recycled.pair, &none.recycled.pair),
        ("positions", &masked.structure.atom37, &none.structure.atom37),
    ] {
        let d = diff(a, b);
        assert!(d < 1e-4, "{what}: padding templates changed the result by {d}");
    }
    assert!(diff(&real.recycled.pair, &none.recycled.pair) > 1e-3, "a real template must change the pair");

    let t = templates(true, 1).map(|x| x.squeeze_dim(0));
    let f = pair_features(&t).unwrap();
    assert_eq!(f.size(), [1, SEQ.len() as i64, SEQ.len() as i64, PAIR_FEATURES]);
    let dgram_rows = f.narrow(-1, 0, 39).sum_dim_intlist(-1, false, Kind::Float);
    let off_diagonal = dgram_rows.get(0).get(0).get(3).double_value(&[]);
    assert!(off_diagonal <= 1.0, "a distance falls in at most one bin");
}

#[test]
fn template_features_load_from_npz_and_bad_shapes_are_named() {
    let d = scratch("npz");
    let path = d.join("f.npz");
    features_with(Some(templates(true, 2))).save_npz(&path).unwrap();
    let back = Features::load_npz(&path, Device::Cpu).unwrap();
    let t = back.templates.expect("template features read back");
    assert_eq!(t.all_atom_positions.size(), [2, 1, SEQ.len() as i64, 37, 3]);

    let mut arrays: Vec<(String, Tensor)> = Tensor::read_npz(&path).unwrap();
    for (k, v) in arrays.iter_mut() {
        if k == "template_pseudo_beta_mask" {
            *v = Tensor::ones([2, 1, 3], F);
        }
    }
    let bad = d.join("bad.npz");
    data::checkpoint::save_npz(&arrays, &bad).unwrap();
    let err = Features::load_npz(&bad, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("bad.npz") && err.contains("template_pseudo_beta_mask") && err.contains("[2, 1, 3]"), "{err}");

    // Any template key asks for all six: a file without the first (which once decided whether
    // templates were there) would otherwise lose its templates silently.
    let arrays: Vec<(String, Tensor)> =
        Tensor::read_npz(&path).unwrap().into_iter().filter(|(k, _)| k != "template_aatype").collect();
    data::checkpoint::save_npz(&arrays, &bad).unwrap();
    let err = Features::load_npz(&bad, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("bad.npz") && err.contains("missing key template_aatype"), "{err}");
    let mut arrays: Vec<(String, Tensor)> = Tensor::read_npz(&path).unwrap();
    for (k, v) in arrays.iter_mut() {
        if k == "template_aatype" {
            *v = v.fill(22);
        }
    }
    data::checkpoint::save_npz(&arrays, &bad).unwrap();
    let err = Features::load_npz(&bad, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("key template_aatype: values from 22 to 22, the model takes 0 to 21"), "{err}");
}

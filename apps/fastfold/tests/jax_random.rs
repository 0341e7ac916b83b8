//! JAX's random numbers, bit for bit: every key, split, fold-in, bits, uniform draw and
//! AlphaFold's padding-consistent uniform of `fastfold::jax_random` equals what JAX itself
//! computed (`fixtures/make_jax_random.py`, jax 0.10.2) for five seeds, among them one past
//! 2^32 and a negative one.
use fastfold::jax_random::Key;
use serde_json::Value;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jax_random.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("the fixture")).expect("JSON")
}

fn words(v: &Value) -> Vec<u32> {
    v.as_array().expect("a list").iter().map(|x| x.as_u64().expect("a word") as u32).collect()
}

fn keys(v: &Value) -> Vec<Key> {
    words(v).chunks(2).map(|w| Key([w[0], w[1]])).collect()
}

#[test]
fn every_draw_equals_jax() {
    let cases = fixture()["cases"].as_array().expect("cases").clone();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let seed = case["seed"].as_i64().expect("a seed");
        let key = Key::from_seed(seed);
        assert_eq!(vec![key], keys(&case["key"]), "PRNGKey({seed})");
        assert_eq!(key.split(3), keys(&case["split3"]), "split(PRNGKey({seed}), 3)");
        for (data, want) in case["fold_in"].as_object().expect("fold-ins") {
            let data: u32 = data.parse().expect("a word");
            assert_eq!(vec![key.fold_in(data)], keys(want), "fold_in(PRNGKey({seed}), {data})");
        }
        assert_eq!(key.bits(7), words(&case["bits7"]), "bits(PRNGKey({seed}), (7,))");
        let bits_of = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits_of(key.uniform(6)), words(&case["uniform_2x3"]), "uniform(PRNGKey({seed}), (2, 3))");
        assert_eq!(
            bits_of(key.padding_consistent_uniform(&[3, 4])),
            words(&case["padding_consistent_3x4"]),
            "padding_consistent_rng(uniform)(PRNGKey({seed}), (3, 4))"
        );
    }
}

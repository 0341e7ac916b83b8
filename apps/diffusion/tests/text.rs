//! The CLIP tokenizer and text encoder against transformers 5's outputs on the tiny fixture
//! model (`fixtures/text/make_text_fixtures.py`): token ids and masks exactly (and open_clip's
//! ids where it agrees with transformers), hidden states within 1e-4 (fp32) from files of both
//! key layouts, and the errors bad files give.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use diffusion::clip::{ClipTextModel, KeyLayout};
use diffusion::tokenizer::ClipTokenizer;
use serde_json::Value;
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text")
}

fn reference() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixtures().join("reference.safetensors")).unwrap().into_iter().collect()
}

fn tokens_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("tokens.json")).unwrap()).unwrap()
}

fn ints(v: &Value) -> Vec<Vec<i64>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()).collect()
}

/// Largest absolute difference, asserted below `tol`.
fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    assert_eq!(got.size(), want.size(), "{what}: shapes");
    let diff = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
    assert!(diff <= tol, "{what}: max abs difference {diff} above {tol}");
}

fn temp_dir(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-text", name)
}

#[test]
fn token_ids_match_transformers_exactly() {
    let refs = tokens_json();
    let prompts: Vec<&str> = refs["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    // Each tokenizer in the hub's layout (vocab.json, merges.txt) and as transformers 5 saves it
    // (tokenizer.json only).
    for (name, dir) in
        [("sd1", "tokenizer"), ("sd1", "tokenizer_v5"), ("sd2", "sd2/tokenizer"), ("sd2", "sd2/tokenizer_v5")]
    {
        let tok = ClipTokenizer::from_dir(&fixtures().join(dir)).unwrap();
        assert_eq!(tok.pad_id(), refs[name]["pad_token_id"].as_i64().unwrap(), "{name} pad id");
        assert_eq!(tok.max_len(), 77);
        let (ids, masks) = (ints(&refs[name]["input_ids"]), ints(&refs[name]["attention_mask"]));
        for (i, prompt) in prompts.iter().enumerate() {
            let e = tok.encode(prompt);
            assert_eq!(e.ids, ids[i], "{name} ids of prompt {i} {prompt:?}");
            assert_eq!(e.attention_mask, masks[i], "{name} mask of prompt {i} {prompt:?}");
        }
        let (t, m) = tok.encode_batch(&prompts, Device::Cpu).unwrap();
        assert_eq!(t.size(), [prompts.len() as i64, 77]);
        assert_eq!(Vec::<i64>::try_from(t.get(3)).unwrap(), ids[3]);
        assert_eq!(Vec::<i64>::try_from(m.get(9)).unwrap(), masks[9]);
    }
    // The BPE pieces themselves, for the prompts without special tokens.
    let tok = ClipTokenizer::from_dir(&fixtures().join("tokenizer")).unwrap();
    for (prompt, want) in prompts.iter().zip(refs["sd1"]["tokens"].as_array().unwrap()) {
        let want: Vec<&str> = want.as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tok.tokenize(prompt), want, "pieces of {prompt:?}");
    }
}

#[test]
fn token_ids_match_open_clip_where_it_agrees_with_transformers() {
    let refs = tokens_json();
    let prompts: Vec<&str> = refs["prompts"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    let differs: Vec<usize> =
        refs["open_clip_differs"].as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as usize).collect();
    // ftfy and HTML unescaping (curly quotes, a control character, full-width letters and
    // ligatures, `&amp;`) are open_clip's own; every other prompt must agree.
    assert_eq!(differs, [4, 17, 18, 19], "the fixture's prompts where open_clip and transformers 5 differ");
    let tok = ClipTokenizer::from_dir(&fixtures().join("tokenizer")).unwrap();
    let open_clip = refs["open_clip"].as_object().unwrap();
    // CJK without spaces (10..=12 and 5), decomposed accents, emoji with a joiner, Unicode spaces.
    for i in [5, 10, 11, 12, 13, 14, 15, 16] {
        assert!(open_clip.contains_key(&i.to_string()), "prompt {i} has open_clip ids");
    }
    for (i, want) in open_clip {
        let i: usize = i.parse().unwrap();
        let mut ids = vec![tok.bos_id()];
        ids.extend(tok.token_ids(prompts[i]));
        ids.push(tok.eos_id());
        let want: Vec<i64> = want.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
        assert_eq!(ids == want, !differs.contains(&i), "prompt {i} {:?}: ours {ids:?}, open_clip {want:?}", prompts[i]);
    }
}

#[test]
fn tokenizer_errors_name_the_file_and_key() {
    let src = fixtures().join("tokenizer");
    let dir = temp_dir("tok");
    for f in ["vocab.json", "special_tokens_map.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("merges.txt"), "{err}");

    std::fs::write(dir.join("merges.txt"), "#version: 0.2\na b c\n").unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("merges.txt") && err.contains("line 2"), "{err}");

    std::fs::copy(src.join("merges.txt"), dir.join("merges.txt")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"pad_token": "<|endoftext|>"}"#).unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("model_max_length"), "{err}");

    std::fs::write(dir.join("tokenizer_config.json"), r#"{"model_max_length": 77}"#).unwrap();
    std::fs::write(dir.join("special_tokens_map.json"), r#"{"pad_token": "<pad>"}"#).unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("vocab.json") && err.contains("pad_token") && err.contains("<pad>"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    // transformers 5's layout: a merge that is not a pair, a model that is not BPE.
    let dir = temp_dir("tok-v5");
    let src = fixtures().join("tokenizer_v5");
    std::fs::copy(src.join("tokenizer_config.json"), dir.join("tokenizer_config.json")).unwrap();
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap()).unwrap();
    json["model"]["merges"][3] = serde_json::json!(["a"]);
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json") && err.contains("model.merges[3]"), "{err}");
    json["model"]["type"] = "WordPiece".into();
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json") && err.contains("WordPiece"), "{err}");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let err = ClipTokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("vocab.json"), "{err}");
}

#[test]
fn text_encoder_matches_transformers() {
    let r = reference();
    let (_vs, model) = ClipTextModel::load(&fixtures().join("text_encoder"), Device::Cpu).unwrap();
    let ids = &r["input_ids"];
    let last = model.forward(ids, None).unwrap();
    assert_close(&last, &r["last_hidden_state"], 1e-4, "last_hidden_state");
    assert_close(&model.pooled(ids, &last).unwrap(), &r["pooled"], 1e-4, "pooled");
    let skip = model.forward_skip(&ids.narrow(0, 0, 1).narrow(1, 0, 16), None, 1).unwrap();
    assert_close(&skip, &r["clip_skip1"], 1e-4, "clip_skip 1");

    let refs = tokens_json();
    let mask = Tensor::from_slice(&ints(&refs["sd1"]["attention_mask"])[1]).view([1, 77]);
    let masked = model.forward(&ids.narrow(0, 1, 1), Some(&mask)).unwrap();
    assert_close(&masked, &r["masked"], 1e-4, "with attention mask");
    // The mask changes the padding positions' states, so the comparison above is not vacuous.
    let unmasked = last.narrow(0, 1, 1);
    assert!((&unmasked - &masked).abs().max().double_value(&[]) > 1e-3);

    let (_vs, gelu) = ClipTextModel::load_files(
        &fixtures().join("text_encoder_gelu.json"),
        &fixtures().join("text_encoder/model.safetensors"),
        Device::Cpu,
    )
    .unwrap();
    assert_close(
        &gelu.forward(&ids.narrow(0, 0, 1).narrow(1, 0, 16), None).unwrap(),
        &r["gelu"],
        1e-4,
        "gelu activation",
    );
}

#[test]
fn text_encoder_loads_the_layouts_of_transformers_4_and_5() {
    let r = reference();
    let ids = &r["input_ids"];
    let (_vs, old) = ClipTextModel::load(&fixtures().join("text_encoder"), Device::Cpu).unwrap();
    let (_vs, new) = ClipTextModel::load(&fixtures().join("text_encoder_v5"), Device::Cpu).unwrap();
    assert_eq!(old.key_layout(), KeyLayout::Prefixed);
    assert_eq!(new.key_layout(), KeyLayout::Bare);
    assert!(new.key_layout().to_string().contains("transformers 5"));
    assert_close(&new.forward(ids, None).unwrap(), &r["last_hidden_state"], 1e-4, "transformers 5 layout");
    // A bare file with a missing key names the key as the file would have it.
    let dir = temp_dir("enc5");
    std::fs::copy(fixtures().join("text_encoder_v5/config.json"), dir.join("config.json")).unwrap();
    let mut weights = Tensor::read_safetensors(fixtures().join("text_encoder_v5/model.safetensors")).unwrap();
    assert!(weights.iter().all(|(k, _)| !k.starts_with("text_model.")));
    weights.retain(|(k, _)| k != "final_layer_norm.weight");
    Tensor::write_safetensors(&weights, dir.join("model.safetensors")).unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("missing key final_layer_norm.weight") && err.contains("model.safetensors"), "{err}");
    // Neither layout: named.
    weights.retain(|(k, _)| !k.contains("token_embedding"));
    Tensor::write_safetensors(&weights, dir.join("model.safetensors")).unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("token_embedding") && err.contains("model.safetensors"), "{err}");
}

#[test]
fn text_encoder_rejects_bad_inputs_and_files() {
    let (_vs, model) = ClipTextModel::load(&fixtures().join("text_encoder"), Device::Cpu).unwrap();
    let vocab = model.config().vocab_size;
    let err = model.forward(&Tensor::from_slice(&[0i64, vocab]).view([1, 2]), None).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    let err = model.forward(&Tensor::zeros([1, 78], (Kind::Int64, Device::Cpu)), None).unwrap_err().to_string();
    assert!(err.contains("[1, 78]"), "{err}");
    let err = model.forward_skip(&Tensor::zeros([1, 3], (Kind::Int64, Device::Cpu)), None, 2).unwrap_err().to_string();
    assert!(err.contains("clip_skip 2"), "{err}");

    let dir = temp_dir("enc");
    std::fs::copy(fixtures().join("text_encoder/config.json"), dir.join("config.json")).unwrap();
    let mut weights = Tensor::read_safetensors(fixtures().join("text_encoder/model.safetensors")).unwrap();
    let key = "text_model.encoder.layers.1.mlp.fc2.weight";
    weights.retain(|(k, _)| k != key);
    Tensor::write_safetensors(&weights, dir.join("model.safetensors")).unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains(key) && err.contains("model.safetensors"), "{err}");

    weights.push((key.to_string(), Tensor::zeros([32, 48], (Kind::Float, Device::Cpu))));
    weights.push(("text_projection.weight".to_string(), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu))));
    Tensor::write_safetensors(&weights, dir.join("model.safetensors")).unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("text_projection.weight"), "{err}");

    std::fs::write(dir.join("config.json"), r#"{"vocab_size": 10}"#).unwrap();
    let err = ClipTextModel::load(&dir, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("config.json") && err.contains("hidden_size"), "{err}");
}

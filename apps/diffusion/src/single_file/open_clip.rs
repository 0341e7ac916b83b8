//! SD 2.x's text encoder between OpenCLIP's names (`cond_stage_model.model.*` in a single file)
//! and transformers' `CLIPTextModel`, and SDXL's second one (`conditioner.embedders.1.model.*`)
//! and `CLIPTextModelWithProjection`, which keeps every layer and the projection.
//!
//! OpenCLIP fuses each attention's query, key and value into `attn.in_proj_weight` `[3d, d]` and
//! `in_proj_bias` `[3d]` (q, k, v stacked in that order, as `torch.nn.MultiheadAttention`);
//! transformers keeps `q_proj`, `k_proj`, `v_proj` apart. SD 2.x conditions on the penultimate
//! layer's output, so diffusers' text encoder has one layer fewer than the file (23 of ViT-H's 24):
//! resblocks at or past the config's `num_hidden_layers` are left out, as are the contrastive
//! head's `text_projection` and `logit_scale`, which `CLIPTextModel` lacks.
use tch::Tensor;

/// Keys of the file that are not part of the text encoder diffusers builds.
const NOT_TEXT_ENCODER: [&str; 3] = ["text_projection", "logit_scale", "attn_mask"];

/// Layer parts: OpenCLIP name → transformers name (inside `encoder.layers.i.`).
const LAYER_PARTS: [(&str, &str); 5] = [
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("attn.out_proj.", "self_attn.out_proj."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
];

/// Outer parts: OpenCLIP name → transformers name (after `text_model.`).
const OUTER_PARTS: [(&str, &str); 3] = [
    ("token_embedding.weight", "embeddings.token_embedding.weight"),
    ("positional_embedding", "embeddings.position_embedding.weight"),
    ("ln_final.", "final_layer_norm."),
];

/// Converts one OpenCLIP tensor (`key` without its file prefix) into transformers' prefixed
/// names (`text_model.…`), appended to `out`; `layers` is the text encoder's
/// `num_hidden_layers`; with `projection` (a `CLIPTextModelWithProjection`, SDXL's second
/// encoder) OpenCLIP's `text_projection` `[width, dim]` (applied as `x @ p`) becomes the linear
/// layer's `text_projection.weight` `[dim, width]`. Keys outside the text encoder add nothing;
/// for an unknown key or a fused projection that does not split in three, the error says what is
/// wrong (the caller names the key).
pub fn to_transformers(
    key: &str,
    t: Tensor,
    layers: usize,
    projection: bool,
    out: &mut Vec<(String, Tensor)>,
) -> Result<(), String> {
    if projection && key == "text_projection" {
        out.push(("text_projection.weight".to_string(), t.transpose(0, 1).contiguous()));
        return Ok(());
    }
    if NOT_TEXT_ENCODER.contains(&key) {
        return Ok(());
    }
    if let Some(name) = OUTER_PARTS.iter().find_map(|(a, b)| key.strip_prefix(a).map(|r| format!("{b}{r}"))) {
        out.push((format!("text_model.{name}"), t));
        return Ok(());
    }
    let unknown = || "has no CLIPTextModel equivalent".to_string();
    let s = key.strip_prefix("transformer.resblocks.").ok_or_else(unknown)?;
    let (i, rest) = s.split_once('.').ok_or_else(unknown)?;
    let i: usize = i.parse().map_err(|_| unknown())?;
    // SD 2.x's encoder is the OpenCLIP model without its last block (the pipeline reads the
    // penultimate layer): diffusers drops that block, and so does this. Any other block past the
    // config's layers would be dropped silently.
    if i == layers && !projection {
        return Ok(());
    }
    if i >= layers {
        return Err(format!("is block {i}, past the text encoder config's num_hidden_layers {layers}"));
    }
    let layer = format!("text_model.encoder.layers.{i}");
    if let Some(kind) = rest.strip_prefix("attn.in_proj_") {
        if kind != "weight" && kind != "bias" {
            return Err(unknown());
        }
        let rows = t.size().first().copied().unwrap_or(0);
        if rows == 0 || rows % 3 != 0 {
            return Err(format!("has shape {:?}, which does not split into query, key and value", t.size()));
        }
        for (part, chunk) in ["q", "k", "v"].iter().zip(t.chunk(3, 0)) {
            out.push((format!("{layer}.self_attn.{part}_proj.{kind}"), chunk.contiguous()));
        }
        return Ok(());
    }
    let name =
        LAYER_PARTS.iter().find_map(|(a, b)| rest.strip_prefix(a).map(|r| format!("{b}{r}"))).ok_or_else(unknown)?;
    out.push((format!("{layer}.{name}"), t));
    Ok(())
}

/// The OpenCLIP form (keys without the file prefix) of a `CLIPTextModel`'s tensors in the
/// prefixed layout (or a `CLIPTextModelWithProjection`'s, whose `text_projection.weight` becomes
/// `text_projection`): the inverse of [`to_transformers`] for the layers the model has. A query,
/// key or value projection without its two partners is an error message naming it.
pub fn from_transformers(tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>, String> {
    let mut out = vec![];
    // (layer, weight|bias) → [q, k, v]
    let mut fused: std::collections::BTreeMap<(usize, String), [Option<Tensor>; 3]> = Default::default();
    for (key, t) in tensors {
        if key == "text_projection.weight" {
            out.push(("text_projection".to_string(), t.transpose(0, 1).contiguous()));
            continue;
        }
        let unknown = || format!("key {key} has no OpenCLIP equivalent");
        let rest = key.strip_prefix("text_model.").ok_or_else(unknown)?;
        if rest == "embeddings.position_ids" {
            continue;
        }
        if let Some(name) = OUTER_PARTS.iter().find_map(|(a, b)| rest.strip_prefix(b).map(|r| format!("{a}{r}"))) {
            out.push((name, t));
            continue;
        }
        let s = rest.strip_prefix("encoder.layers.").ok_or_else(unknown)?;
        let (i, part) = s.split_once('.').ok_or_else(unknown)?;
        let i: usize = i.parse().map_err(|_| unknown())?;
        let projection = ["q", "k", "v"]
            .iter()
            .enumerate()
            .find_map(|(n, p)| part.strip_prefix(&format!("self_attn.{p}_proj.")).map(|kind| (n, kind.to_string())));
        if let Some((n, kind)) = projection {
            fused.entry((i, kind)).or_default()[n] = Some(t);
            continue;
        }
        let name = LAYER_PARTS
            .iter()
            .find_map(|(a, b)| part.strip_prefix(b).map(|r| format!("{a}{r}")))
            .ok_or_else(unknown)?;
        out.push((format!("transformer.resblocks.{i}.{name}"), t));
    }
    for ((i, kind), parts) in fused {
        let [Some(q), Some(k), Some(v)] = parts else {
            return Err(format!(
                "text_model.encoder.layers.{i}.self_attn: the query, key and value {kind}s are not all present"
            ));
        };
        out.push((format!("transformer.resblocks.{i}.attn.in_proj_{kind}"), Tensor::cat(&[q, k, v], 0)));
    }
    Ok(out)
}

//! Key names of the UNet and the VAE between latent-diffusion's single files and diffusers'
//! folders, both ways. The UNet's arithmetic (which `input_blocks.i` is which down block's
//! resnet, attention or downsampler) follows from `layers_per_block`; where an up block's
//! upsampler sits (after its attention or in its place) from whether the block has attention.
/// Resnet parts: latent-diffusion name → diffusers name.
fn resnet_part(rest: &str) -> String {
    const PARTS: [(&str, &str); 6] = [
        ("in_layers.0.", "norm1."),
        ("in_layers.2.", "conv1."),
        ("emb_layers.1.", "time_emb_proj."),
        ("out_layers.0.", "norm2."),
        ("out_layers.3.", "conv2."),
        ("skip_connection.", "conv_shortcut."),
    ];
    PARTS.iter().find_map(|(a, b)| rest.strip_prefix(a).map(|r| format!("{b}{r}"))).unwrap_or_else(|| rest.to_string())
}

/// `(index, rest)` of `<index>.<rest>`.
fn split_index(s: &str) -> Option<(usize, &str)> {
    let (i, rest) = s.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

/// The diffusers name of a UNet key (without the `model.diffusion_model.` prefix).
pub fn unet_key(key: &str, layers_per_block: usize) -> Option<String> {
    let per = layers_per_block + 1;
    if let Some(r) = key.strip_prefix("time_embed.0.") {
        return Some(format!("time_embedding.linear_1.{r}"));
    }
    if let Some(r) = key.strip_prefix("time_embed.2.") {
        return Some(format!("time_embedding.linear_2.{r}"));
    }
    // SDXL's text-time embedding (`add_embedding`), `label_emb` in latent-diffusion.
    if let Some(r) = key.strip_prefix("label_emb.0.0.") {
        return Some(format!("add_embedding.linear_1.{r}"));
    }
    if let Some(r) = key.strip_prefix("label_emb.0.2.") {
        return Some(format!("add_embedding.linear_2.{r}"));
    }
    if let Some(r) = key.strip_prefix("input_blocks.0.0.") {
        return Some(format!("conv_in.{r}"));
    }
    if let Some(r) = key.strip_prefix("out.0.") {
        return Some(format!("conv_norm_out.{r}"));
    }
    if let Some(r) = key.strip_prefix("out.2.") {
        return Some(format!("conv_out.{r}"));
    }
    if let Some(s) = key.strip_prefix("input_blocks.") {
        let (i, s) = split_index(s)?;
        let (part, rest) = split_index(s)?;
        // Block 0 is `conv_in` (above): a key under input_blocks.0 that is not has no name.
        let i = i.checked_sub(1)?;
        let (block, layer) = (i / per, i % per);
        return match (layer == layers_per_block, part) {
            (true, 0) => rest.strip_prefix("op.").map(|r| format!("down_blocks.{block}.downsamplers.0.conv.{r}")),
            (false, 0) => Some(format!("down_blocks.{block}.resnets.{layer}.{}", resnet_part(rest))),
            (false, 1) => Some(format!("down_blocks.{block}.attentions.{layer}.{rest}")),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("middle_block.") {
        let (part, rest) = split_index(s)?;
        return match part {
            0 | 2 => Some(format!("mid_block.resnets.{}.{}", part / 2, resnet_part(rest))),
            1 => Some(format!("mid_block.attentions.0.{rest}")),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("output_blocks.") {
        let (i, s) = split_index(s)?;
        let (part, rest) = split_index(s)?;
        let (block, layer) = (i / per, i % per);
        return match part {
            0 => Some(format!("up_blocks.{block}.resnets.{layer}.{}", resnet_part(rest))),
            // An upsampler sits at 1 in blocks without attention, at 2 after an attention.
            1 | 2 if rest.starts_with("conv.") => Some(format!("up_blocks.{block}.upsamplers.0.{rest}")),
            1 => Some(format!("up_blocks.{block}.attentions.{layer}.{rest}")),
            _ => None,
        };
    }
    None
}

/// The diffusers name of a VAE key (without `first_stage_model.`); `levels` is the number of
/// resolution levels (the decoder's `up.i` run deepest first).
pub fn vae_key(key: &str, levels: usize) -> Option<String> {
    let (side, rest) = key.split_once('.')?;
    if side != "encoder" && side != "decoder" {
        return matches!(side, "quant_conv" | "post_quant_conv").then(|| key.to_string());
    }
    let resnet = |r: &str| r.replace("nin_shortcut.", "conv_shortcut.");
    let mapped = if let Some(r) = rest.strip_prefix("norm_out.") {
        format!("conv_norm_out.{r}")
    } else if rest.starts_with("conv_in.") || rest.starts_with("conv_out.") {
        rest.to_string()
    } else if let Some(r) = rest.strip_prefix("mid.block_1.") {
        format!("mid_block.resnets.0.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid.block_2.") {
        format!("mid_block.resnets.1.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid.attn_1.") {
        let (part, tail) = r.split_once('.')?;
        let name = match part {
            "norm" => "group_norm",
            "q" => "to_q",
            "k" => "to_k",
            "v" => "to_v",
            "proj_out" => "to_out.0",
            _ => return None,
        };
        format!("mid_block.attentions.0.{name}.{tail}")
    } else {
        let (dir, s) =
            if let Some(s) = rest.strip_prefix("down.") { ("down", s) } else { ("up", rest.strip_prefix("up.")?) };
        let (i, s) = split_index(s)?;
        let level = if dir == "down" { i } else { levels.checked_sub(1 + i)? };
        let blocks = format!("{dir}_blocks.{level}");
        if let Some(s) = s.strip_prefix("block.") {
            let (j, r) = split_index(s)?;
            format!("{blocks}.resnets.{j}.{}", resnet(r))
        } else if let Some(r) = s.strip_prefix("downsample.").or_else(|| s.strip_prefix("upsample.")) {
            format!("{blocks}.{dir}samplers.0.{r}")
        } else {
            return None;
        }
    };
    Some(format!("{side}.{mapped}"))
}

/// `(a, b)` pairs of [`resnet_part`], read the other way: diffusers name → latent-diffusion.
fn resnet_ldm_part(rest: &str) -> String {
    const PARTS: [(&str, &str); 6] = [
        ("norm1.", "in_layers.0."),
        ("conv1.", "in_layers.2."),
        ("time_emb_proj.", "emb_layers.1."),
        ("norm2.", "out_layers.0."),
        ("conv2.", "out_layers.3."),
        ("conv_shortcut.", "skip_connection."),
    ];
    PARTS.iter().find_map(|(a, b)| rest.strip_prefix(a).map(|r| format!("{b}{r}"))).unwrap_or_else(|| rest.to_string())
}

/// `(block, kind, index, rest)` of `<block>.<kind>.<index>.<rest>`.
fn split_block(s: &str) -> Option<(usize, &str, usize, &str)> {
    let (block, s) = split_index(s)?;
    let (kind, s) = s.split_once('.')?;
    let (index, rest) = split_index(s)?;
    Some((block, kind, index, rest))
}

/// The latent-diffusion name (without `model.diffusion_model.`) of a diffusers UNet key: the
/// inverse of [`unet_key`]. `up_attention[b]` says whether up block `b` has attention (its
/// upsampler then follows the attention at position 2, else the resnet at position 1).
pub fn unet_ldm_key(key: &str, layers_per_block: usize, up_attention: &[bool]) -> Option<String> {
    let per = layers_per_block + 1;
    const FIXED: [(&str, &str); 7] = [
        ("time_embedding.linear_1.", "time_embed.0."),
        ("time_embedding.linear_2.", "time_embed.2."),
        ("add_embedding.linear_1.", "label_emb.0.0."),
        ("add_embedding.linear_2.", "label_emb.0.2."),
        ("conv_in.", "input_blocks.0.0."),
        ("conv_norm_out.", "out.0."),
        ("conv_out.", "out.2."),
    ];
    if let Some(name) = FIXED.iter().find_map(|(a, b)| key.strip_prefix(a).map(|r| format!("{b}{r}"))) {
        return Some(name);
    }
    if let Some(s) = key.strip_prefix("down_blocks.") {
        let (block, kind, layer, rest) = split_block(s)?;
        let i = 1 + block * per + layer;
        return match kind {
            "resnets" if layer < layers_per_block => Some(format!("input_blocks.{i}.0.{}", resnet_ldm_part(rest))),
            "attentions" if layer < layers_per_block => Some(format!("input_blocks.{i}.1.{rest}")),
            "downsamplers" if layer == 0 => rest
                .strip_prefix("conv.")
                .map(|r| format!("input_blocks.{}.0.op.{r}", 1 + block * per + layers_per_block)),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("mid_block.") {
        let (kind, s) = s.split_once('.')?;
        let (j, rest) = split_index(s)?;
        return match (kind, j) {
            ("resnets", 0 | 1) => Some(format!("middle_block.{}.{}", 2 * j, resnet_ldm_part(rest))),
            ("attentions", 0) => Some(format!("middle_block.1.{rest}")),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("up_blocks.") {
        let (block, kind, layer, rest) = split_block(s)?;
        let i = block * per + layer;
        return match kind {
            "resnets" if layer < per => Some(format!("output_blocks.{i}.0.{}", resnet_ldm_part(rest))),
            "attentions" if layer < per => Some(format!("output_blocks.{i}.1.{rest}")),
            "upsamplers" if layer == 0 && rest.starts_with("conv.") => {
                let at = if *up_attention.get(block)? { 2 } else { 1 };
                Some(format!("output_blocks.{}.{at}.{rest}", block * per + layers_per_block))
            }
            _ => None,
        };
    }
    None
}

/// The latent-diffusion name (without `first_stage_model.`) of a diffusers VAE key: the inverse
/// of [`vae_key`]. The mid-block attention's projection weights must then be stored as 1x1
/// convolutions ([`vae_ldm_is_conv`]).
pub fn vae_ldm_key(key: &str, levels: usize) -> Option<String> {
    let (side, rest) = key.split_once('.')?;
    if side != "encoder" && side != "decoder" {
        return matches!(side, "quant_conv" | "post_quant_conv").then(|| key.to_string());
    }
    let resnet = |r: &str| r.replace("conv_shortcut.", "nin_shortcut.");
    let mapped = if let Some(r) = rest.strip_prefix("conv_norm_out.") {
        format!("norm_out.{r}")
    } else if rest.starts_with("conv_in.") || rest.starts_with("conv_out.") {
        rest.to_string()
    } else if let Some(r) = rest.strip_prefix("mid_block.resnets.0.") {
        format!("mid.block_1.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid_block.resnets.1.") {
        format!("mid.block_2.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid_block.attentions.0.") {
        const PARTS: [(&str, &str); 5] =
            [("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."), ("to_out.0.", "proj_out.")];
        let name = PARTS.iter().find_map(|(a, b)| r.strip_prefix(a).map(|t| format!("{b}{t}")))?;
        format!("mid.attn_1.{name}")
    } else {
        let (dir, s) = if let Some(s) = rest.strip_prefix("down_blocks.") {
            ("down", s)
        } else {
            ("up", rest.strip_prefix("up_blocks.")?)
        };
        let (level, kind, j, r) = split_block(s)?;
        let i = if dir == "down" { level } else { levels.checked_sub(1 + level)? };
        match kind {
            "resnets" => format!("{dir}.{i}.block.{j}.{}", resnet(r)),
            "downsamplers" | "upsamplers" if j == 0 => format!("{dir}.{i}.{dir}sample.{r}"),
            _ => return None,
        }
    };
    Some(format!("{side}.{mapped}"))
}

/// Whether a latent-diffusion VAE key is a projection of the mid-block attention, which the
/// single file stores as a 1x1 convolution `[out, in, 1, 1]` (diffusers: a linear `[out, in]`).
pub fn vae_ldm_is_conv(ldm_key: &str) -> bool {
    ["q.weight", "k.weight", "v.weight", "proj_out.weight"]
        .iter()
        .any(|w| ldm_key.strip_suffix(w).is_some_and(|p| p.ends_with(".attn_1.")))
}

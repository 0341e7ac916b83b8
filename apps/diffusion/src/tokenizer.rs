//! CLIP's byte-level BPE tokenizer, as transformers 5's `CLIPTokenizer` (the tokenizer diffusers
//! pipelines load) runs it, reading a diffusers `tokenizer/` folder: the vocabulary and merges
//! from `vocab.json` and `merges.txt` (the hub's files, transformers 4's `save_pretrained`) or
//! from `tokenizer.json` (all transformers 5's `save_pretrained` writes), `tokenizer_config.json`
//! (`model_max_length`) and, when present, `special_tokens_map.json`, whose tokens win over the
//! config's as in transformers (SD 2.x pads with `!`, id 0; SD 1.x with `<|endoftext|>`).
//!
//! The pipeline: the text is split around the special tokens (bos, eos, unk, pad) that appear in
//! it verbatim; each piece is normalised (Unicode NFC, every whitespace run to one space, lower
//! case), cut by CLIP's pre-tokenisation pattern, mapped byte by byte to printable characters,
//! and merged by rank with `</w>` on each word's last symbol. `encode` adds
//! `<|startoftext|>`/`<|endoftext|>`, truncates and pads to the model length.
//!
//! OpenAI's CLIP and open_clip tokenize the same way (no spaces around CJK ideographs, unlike
//! transformers 4's fallback path) except that they first run ftfy and unescape HTML: for
//! full-width letters, ligatures, curly quotes, control characters and `&amp;`-style entities
//! their ids differ from transformers' and ours.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use regex::Regex;
use serde_json::Value;
use tch::{Device, Tensor};
use unicode_normalization::UnicodeNormalization;

use crate::config::read_json;
use crate::error::{Error, Result};

/// CLIP's pre-tokenisation pattern (transformers 5's `Split`, on lower-cased text):
/// contractions, letter runs, single digits, and runs of anything else that is not whitespace.
const PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+";

/// Token ids and attention mask of one text, padded to the model length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoding {
    /// `<|startoftext|>`, the text's tokens, `<|endoftext|>`, then the pad id.
    pub ids: Vec<i64>,
    /// 1 for the start, text and end tokens, 0 for padding.
    pub attention_mask: Vec<i64>,
}

/// CLIP's tokenizer (see the module docs).
pub struct ClipTokenizer {
    encoder: HashMap<String, i64>,
    ranks: MergeRanks,
    byte_chars: Vec<char>,
    pattern: Regex,
    whitespace: Regex,
    /// Special token strings split out of raw text, longest first, with their ids.
    specials: Vec<(String, i64)>,
    cache: Mutex<HashMap<String, Vec<String>>>,
    bos: i64,
    eos: i64,
    pad: i64,
    unk: i64,
    max_len: usize,
}

/// GPT-2/CLIP's reversible map from bytes to printable characters: printable Latin-1 bytes map
/// to themselves, the rest to code points from 256 up, in byte order.
pub(crate) fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut next = 256u32;
    (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap_or('\u{fffd}')
        })
        .collect()
}

/// A special token's text in a tokenizer JSON: a string or an object with `content`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn format_err(path: &Path, msg: impl Into<String>) -> Error {
    Error::Format { path: path.to_path_buf(), msg: msg.into() }
}

impl ClipTokenizer {
    /// Reads the `tokenizer/` folder of a diffusers model folder.
    pub fn from_diffusers(model_dir: &Path) -> Result<ClipTokenizer> {
        Self::from_dir(&model_dir.join("tokenizer"))
    }

    /// Reads a tokenizer folder (`vocab.json` and `merges.txt`, or `tokenizer.json`;
    /// `tokenizer_config.json`, optional `special_tokens_map.json`). A missing file, key or
    /// token is an error naming the file.
    pub fn from_dir(dir: &Path) -> Result<ClipTokenizer> {
        let (vocab_path, merges_path, json_path) =
            (dir.join("vocab.json"), dir.join("merges.txt"), dir.join("tokenizer.json"));
        let (encoder, ranks) = if !vocab_path.exists() && !merges_path.exists() && json_path.exists() {
            read_tokenizer_json(&json_path)?
        } else {
            (read_json::<HashMap<String, i64>>(&vocab_path)?, read_merges(&merges_path)?)
        };
        // Where a special token missing from the vocabulary is reported.
        let vocab_path = if vocab_path.exists() { vocab_path } else { json_path };

        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Map<String, Value> = read_json(&config_path)?;
        let map_path = dir.join("special_tokens_map.json");
        let map: serde_json::Map<String, Value> =
            if map_path.exists() { read_json(&map_path)? } else { serde_json::Map::new() };
        let max_len = config
            .get("model_max_length")
            .and_then(Value::as_u64)
            .ok_or_else(|| format_err(&config_path, "missing or non-integer key model_max_length"))?
            as usize;
        if max_len < 2 {
            return Err(format_err(&config_path, format!("model_max_length {max_len} leaves no room for text")));
        }
        // transformers' defaults for CLIPTokenizer, overridden by the config, then by the map.
        let special = |key: &str, default: &str| -> Result<(String, i64, PathBuf)> {
            let (text, from) = match (map.get(key), config.get(key)) {
                (Some(v), _) => (token_text(v), map_path.clone()),
                (None, Some(v)) => (token_text(v), config_path.clone()),
                (None, None) => (Some(default.to_owned()), config_path.clone()),
            };
            let text =
                text.ok_or_else(|| format_err(&from, format!("key {key} is neither a string nor {{content}}")))?;
            let id = *encoder.get(&text).ok_or_else(|| {
                format_err(&vocab_path, format!("{key} {text:?} (from {}) is not in the vocabulary", from.display()))
            })?;
            Ok((text, id, from))
        };
        let (bos_text, bos, _) = special("bos_token", "<|startoftext|>")?;
        let (eos_text, eos, _) = special("eos_token", "<|endoftext|>")?;
        let (unk_text, unk, _) = special("unk_token", "<|endoftext|>")?;
        let (pad_text, pad, _) = special("pad_token", "<|endoftext|>")?;
        let mut specials: Vec<(String, i64)> = vec![(bos_text, bos), (eos_text, eos), (unk_text, unk), (pad_text, pad)];
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        specials.dedup();

        let regex = |p: &str| Regex::new(p).map_err(|e| Error::Invalid(format!("tokenizer pattern {p}: {e}")));
        Ok(ClipTokenizer {
            encoder,
            ranks,
            byte_chars: byte_chars(),
            pattern: regex(PATTERN)?,
            whitespace: regex(r"\s+")?,
            specials,
            cache: Mutex::new(HashMap::new()),
            bos,
            eos,
            pad,
            unk,
            max_len,
        })
    }

    /// Tokens per encoded text, start and end tokens included (77 for SD's CLIP).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The padding id (SD 1.x: `<|endoftext|>`; SD 2.x: `!`, id 0).
    pub fn pad_id(&self) -> i64 {
        self.pad
    }

    /// The `<|startoftext|>` id.
    pub fn bos_id(&self) -> i64 {
        self.bos
    }

    /// The `<|endoftext|>` id.
    pub fn eos_id(&self) -> i64 {
        self.eos
    }

    /// Entries in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.encoder.len()
    }

    /// The text's ids without start, end or padding (special tokens written in the text become
    /// their ids, as in transformers).
    pub fn token_ids(&self, text: &str) -> Vec<i64> {
        let mut ids = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            // The earliest special token in `rest`, the longest where two start together.
            let next = self
                .specials
                .iter()
                .filter_map(|(s, id)| rest.find(s.as_str()).map(|at| (at, s.len(), *id)))
                .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
            let (plain, special) = match next {
                Some((at, len, id)) => (&rest[..at], Some((at + len, id))),
                None => (rest, None),
            };
            for piece in self.tokenize(plain) {
                ids.push(self.encoder.get(&piece).copied().unwrap_or(self.unk));
            }
            match special {
                Some((end, id)) => {
                    ids.push(id);
                    rest = &rest[end..];
                }
                None => break,
            }
        }
        ids
    }

    /// The BPE pieces of plain text (no special-token splitting), as `CLIPTokenizer._tokenize`.
    pub fn tokenize(&self, text: &str) -> Vec<String> {
        let cleaned = self.clean(text);
        let mut pieces = Vec::new();
        for m in self.pattern.find_iter(&cleaned) {
            let mapped: String = m.as_str().bytes().map(|b| self.byte_chars[b as usize]).collect();
            pieces.extend(self.bpe(&mapped));
        }
        pieces
    }

    /// Checks that the text encoder configured by `encoder_config` can take every id and the
    /// length this tokenizer (read from `dir`) produces, so a mismatched pair of folders is an
    /// error at load naming both files, not an index error at the first prompt.
    pub fn check_fits(&self, dir: &Path, encoder_config: &Path, vocab_size: i64, max_positions: i64) -> Result<()> {
        let specials = self.specials.iter().map(|(_, id)| *id).chain([self.bos, self.eos, self.pad, self.unk]);
        let top = self.encoder.values().copied().chain(specials).max().unwrap_or(0);
        if top >= vocab_size {
            return Err(format_err(
                dir,
                format!("token ids reach {top}; {} has vocab_size {vocab_size}", encoder_config.display()),
            ));
        }
        if self.max_len as i64 > max_positions {
            return Err(format_err(
                &dir.join("tokenizer_config.json"),
                format!(
                    "model_max_length {} exceeds max_position_embeddings {max_positions} of {}",
                    self.max_len,
                    encoder_config.display()
                ),
            ));
        }
        Ok(())
    }

    /// The text's tokens and how many of them [`ClipTokenizer::encode`] keeps (`max_len`
    /// less the start and end tokens), so callers can say what truncation drops.
    pub fn token_count(&self, text: &str) -> (usize, usize) {
        (self.token_ids(text).len(), self.max_len - 2)
    }

    /// `<|startoftext|>` + ids + `<|endoftext|>`, truncated and padded to `max_len`.
    pub fn encode(&self, text: &str) -> Encoding {
        let mut ids = self.token_ids(text);
        ids.truncate(self.max_len - 2);
        ids.insert(0, self.bos);
        ids.push(self.eos);
        let mut attention_mask = vec![1; ids.len()];
        attention_mask.resize(self.max_len, 0);
        ids.resize(self.max_len, self.pad);
        Encoding { ids, attention_mask }
    }

    /// Encodes a batch: ids and attention mask, each int64 `[texts, max_len]` on `device`.
    pub fn encode_batch(&self, texts: &[&str], device: Device) -> Result<(Tensor, Tensor)> {
        let rows = texts.len() as i64;
        let (mut ids, mut mask) = (Vec::new(), Vec::new());
        for text in texts {
            let e = self.encode(text);
            ids.extend(e.ids);
            mask.extend(e.attention_mask);
        }
        let shape = [rows, self.max_len as i64];
        let ids = Tensor::from_slice(&ids).f_reshape(shape)?.f_to_device(device)?;
        let mask = Tensor::from_slice(&mask).f_reshape(shape)?.f_to_device(device)?;
        Ok((ids, mask))
    }

    /// The normaliser: NFC, whitespace runs to one space, lower case (leading and trailing
    /// spaces fall away in the pre-tokenisation).
    fn clean(&self, text: &str) -> String {
        let composed: String = text.nfc().collect();
        self.whitespace.replace_all(&composed, " ").to_lowercase()
    }

    /// Merges one pre-token's symbols by rank, lowest first, until no ranked pair is left.
    fn bpe(&self, token: &str) -> Vec<String> {
        if let Some(hit) = self.cache.lock().ok().and_then(|c| c.get(token).cloned()) {
            return hit;
        }
        let mut word: Vec<String> = token.chars().map(String::from).collect();
        if let Some(last) = word.last_mut() {
            last.push_str("</w>");
        }
        loop {
            let best = word
                .windows(2)
                .filter_map(|w| self.ranks.get(&(w[0].clone(), w[1].clone())).map(|r| (*r, w[0].clone(), w[1].clone())))
                .min_by_key(|(r, _, _)| *r);
            let Some((_, first, second)) = best else { break };
            let mut merged = Vec::with_capacity(word.len());
            let mut i = 0;
            while i < word.len() {
                if i + 1 < word.len() && word[i] == first && word[i + 1] == second {
                    merged.push(format!("{first}{second}"));
                    i += 2;
                } else {
                    merged.push(std::mem::take(&mut word[i]));
                    i += 1;
                }
            }
            word = merged;
            if word.len() == 1 {
                break;
            }
        }
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(token.to_owned(), word.clone());
        }
        word
    }
}

/// Each merge's rank (its position in the merge list) by its pair.
type MergeRanks = HashMap<(String, String), usize>;

/// `merges.txt`: a `#version` header line, then one `left right` pair per line, in rank order
/// (CLIP reads at most 48,894 of them).
fn read_merges(path: &Path) -> Result<MergeRanks> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let mut ranks = HashMap::new();
    for (n, line) in text.trim().lines().enumerate().skip(1).take(49152 - 256 - 2) {
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) => {
                // A repeated pair keeps its last rank, as transformers' dict does.
                ranks.insert((a.to_owned(), b.to_owned()), n - 1);
            }
            _ => return Err(format_err(path, format!("line {}: expected two symbols, found {line:?}", n + 1))),
        }
    }
    Ok(ranks)
}

/// The vocabulary and merge ranks of a `tokenizer.json` (the `tokenizers` library's file) with
/// a BPE model: `model.vocab` maps tokens to ids, `model.merges` lists the pairs in rank order,
/// each as `[left, right]` (tokenizers 0.20 on) or `"left right"` (before).
fn read_tokenizer_json(path: &Path) -> Result<(HashMap<String, i64>, MergeRanks)> {
    #[derive(serde::Deserialize)]
    struct File {
        model: Model,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        #[serde(rename = "type")]
        kind: Option<String>,
        vocab: HashMap<String, i64>,
        merges: Vec<Value>,
    }
    let file: File = read_json(path)?;
    let model = file.model;
    if let Some(kind) = model.kind.as_deref().filter(|&k| k != "BPE") {
        return Err(format_err(path, format!("model.type is {kind:?}, expected \"BPE\" (CLIP's tokenizer)")));
    }
    let mut ranks = HashMap::new();
    for (rank, merge) in model.merges.iter().enumerate() {
        let pair = match merge {
            Value::Array(p) => match p.as_slice() {
                [Value::String(a), Value::String(b)] => Some((a.clone(), b.clone())),
                _ => None,
            },
            Value::String(text) => text.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())),
            _ => None,
        };
        let pair = pair.ok_or_else(|| format_err(path, format!("model.merges[{rank}] is not a pair: {merge}")))?;
        // A repeated pair keeps its last rank, as for `merges.txt`.
        ranks.insert(pair, rank);
    }
    Ok((model.vocab, ranks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_onto_printables() {
        let chars = byte_chars();
        let mut sorted = chars.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        assert_eq!(chars[b'a' as usize], 'a');
        assert_eq!(chars[b' ' as usize], '\u{120}');
        assert!(chars.iter().all(|c| !c.is_whitespace() && !c.is_control()));
    }
}

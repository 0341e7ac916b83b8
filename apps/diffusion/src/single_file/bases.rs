//! The configurations a single file lacks, shipped with the app for the Stable Diffusion
//! releases (`assets/sd/`): diffusers' folder configs of SD 1.x (v1-5, PNDM) and of SD 2.x at
//! 512 (`-base`, epsilon prediction, PNDM) and 768 (`-v`, v-prediction, DDIM; `upcast_attention`
//! as 2.1), and OpenAI CLIP's BPE merges (`assets/clip/merges.txt.gz`, MIT licence, the list
//! open_clip and transformers' `CLIPTokenizer` read), from which `vocab.json` is built.
use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// A Stable Diffusion release whose configs ship with the app.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Base {
    /// SD 1.x (CLIP ViT-L/14 text encoder, 512 px).
    Sd1,
    /// SD 2.x 512-base (OpenCLIP ViT-H/14, epsilon prediction).
    #[value(name = "sd2-base")]
    Sd2Base,
    /// SD 2.x 768-v (OpenCLIP ViT-H/14, v-prediction).
    #[value(name = "sd2-v")]
    Sd2V,
}

/// `(file in the diffusers folder, contents)` of one base's configs.
type Files = [(&'static str, &'static str); 6];

const VAE: &str = include_str!("../../assets/sd/common/vae.json");

macro_rules! base_files {
    ($dir:literal) => {
        [
            ("model_index.json", include_str!(concat!("../../assets/sd/", $dir, "/model_index.json"))),
            ("unet/config.json", include_str!(concat!("../../assets/sd/", $dir, "/unet.json"))),
            ("vae/config.json", VAE),
            ("text_encoder/config.json", include_str!(concat!("../../assets/sd/", $dir, "/text_encoder.json"))),
            ("scheduler/scheduler_config.json", include_str!(concat!("../../assets/sd/", $dir, "/scheduler.json"))),
            (
                "tokenizer/tokenizer_config.json",
                include_str!(concat!("../../assets/sd/", $dir, "/tokenizer_config.json")),
            ),
        ]
    };
}

const SD1: Files = base_files!("sd1");
const SD2_BASE: Files = base_files!("sd2-base");
const SD2_V: Files = base_files!("sd2-v");

/// OpenAI CLIP's merges, `#version` line first (48,894 pairs), gzipped.
const MERGES_GZ: &[u8] = include_bytes!("../../assets/clip/merges.txt.gz");

impl Base {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Base::Sd1 => "sd1",
            Base::Sd2Base => "sd2-base",
            Base::Sd2V => "sd2-v",
        }
    }

    /// Whether its text encoder is OpenCLIP's (SD 2.x) rather than OpenAI CLIP's (SD 1.x).
    pub fn open_clip(self) -> bool {
        self != Base::Sd1
    }

    fn files(self) -> &'static Files {
        match self {
            Base::Sd1 => &SD1,
            Base::Sd2Base => &SD2_BASE,
            Base::Sd2V => &SD2_V,
        }
    }

    /// Writes the configs, scheduler and tokenizer of a diffusers folder into `dir` (every
    /// file but the weights).
    pub fn write_configs(self, dir: &Path) -> Result<()> {
        for (name, text) in self.files() {
            write(&dir.join(name), text.as_bytes())?;
        }
        let merges = merges()?;
        let vocab = serde_json::to_vec(&vocab(&merges)).map_err(|e| Error::Invalid(format!("vocab.json: {e}")))?;
        write(&dir.join("tokenizer").join("merges.txt"), merges.as_bytes())?;
        write(&dir.join("tokenizer").join("vocab.json"), &vocab)
    }
}

/// Writes `path` atomically, creating its folder.
fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|source| Error::Io { path: parent.to_path_buf(), source })?;
    }
    data::write_atomic::<Error>(path, |w| {
        w.write_all(bytes).map_err(|source| Error::Io { path: path.to_path_buf(), source })
    })
}

/// The shipped merges list, unpacked.
fn merges() -> Result<String> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(MERGES_GZ)
        .read_to_string(&mut text)
        .map_err(|e| Error::Invalid(format!("the shipped CLIP merges list does not unpack: {e}")))?;
    Ok(text)
}

/// CLIP's vocabulary as open_clip builds it from the merges: the 256 byte symbols (in the
/// order of their printable characters), the same with `</w>`, each merge's result in rank
/// order, then `<|startoftext|>` and `<|endoftext|>` (49,408 entries).
fn vocab(merges: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut bytes: Vec<char> = crate::tokenizer::byte_chars();
    // The byte map sends printable bytes to themselves and the rest to 256 upwards, in byte
    // order: sorting by character gives open_clip's order (printables first).
    bytes.sort_unstable();
    let symbols = bytes.iter().map(|c| c.to_string());
    let ends = bytes.iter().map(|c| format!("{c}</w>"));
    let merged = merges.lines().skip(1).filter_map(|l| l.split_once(' ').map(|(a, b)| format!("{a}{b}")));
    let specials = ["<|startoftext|>", "<|endoftext|>"].map(String::from);
    symbols
        .chain(ends)
        .chain(merged)
        .chain(specials)
        .enumerate()
        .map(|(i, s)| (s, serde_json::Value::from(i)))
        .collect()
}

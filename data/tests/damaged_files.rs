//! Files from users are parsed, never trusted: for each format the suite reads (safetensors
//! weights and checkpoints, HDF5 image sets, PNG and JPEG images), a few hundred truncated and
//! bit-flipped copies of a valid file give an error naming the file, or load whole; none panics
//! or aborts the process. (`.npz` has its own, header-editing, test in `npz.rs`.)
use std::path::Path;

mod support;

use support::Lcg;

use data::Dataset;
use tch::{Device, Kind, Tensor};

/// Writes `rounds` damaged copies of `good` to `path` (half truncated, half with one bit
/// flipped) and reads each with `read`: an error must name the file, and nothing may panic.
/// Returns how many were errors.
fn mutate(good: &[u8], path: &Path, rounds: usize, read: impl Fn(&Path) -> Result<(), String>) -> usize {
    let mut rng = Lcg(good.len() as u64);
    let mut errors = 0;
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    for round in 0..rounds {
        let mut bytes = good.to_vec();
        match round % 2 {
            0 => bytes.truncate(rng.below(good.len())),
            _ => {
                let at = rng.below(bytes.len());
                bytes[at] ^= 1 << rng.below(8);
            }
        }
        std::fs::write(path, &bytes).unwrap();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read(path)));
        match result.unwrap_or_else(|_| panic!("round {round}: reading a damaged {name} panicked")) {
            Ok(()) => {}
            Err(e) => {
                errors += 1;
                assert!(e.contains(&name), "round {round}: the error does not name the file: {e}");
            }
        }
    }
    errors
}

#[test]
fn damaged_safetensors_are_errors_naming_the_file() {
    let dir = suite_tests::scratch("data-damaged", "st");
    let good = dir.join("good.safetensors");
    let weights = vec![
        ("a.weight".to_string(), Tensor::arange(64, (Kind::Float, Device::Cpu)).view([8, 8])),
        ("a.bias".to_string(), Tensor::ones([8], (Kind::Float, Device::Cpu))),
    ];
    data::checkpoint::save_tensors(&weights, &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let errors = mutate(&bytes, &dir.join("model.safetensors"), 300, |p| {
        let file = data::checkpoint::read_tensors(p).map_err(|e| e.to_string())?;
        // What loads must have its declared shapes.
        assert!(file.values().all(|t| t.numel() <= 64));
        Ok(())
    });
    // Every truncation is an error; flips inside the data are not detectable (no checksum).
    assert!(errors >= 150, "{errors} of 300 damaged files were errors");
    // A header that lies about one tensor is an error naming its key.
    let header_of = |entry: &str| {
        let json = format!(r#"{{"a.bias":{{"dtype":"F32","shape":[2],"data_offsets":[0,8]}},"a.weight":{entry}}}"#);
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend(json.as_bytes());
        bytes.extend([0u8; 24]);
        let path = dir.join("lying.safetensors");
        std::fs::write(&path, bytes).unwrap();
        data::checkpoint::read_tensors(&path).unwrap_err().to_string()
    };
    for (entry, says) in [
        (r#"{"dtype":"F32","shape":[8],"data_offsets":[8,24]}"#, "F32 [8] needs 32 bytes"),
        (r#"{"dtype":"F31","shape":[4],"data_offsets":[8,24]}"#, "dtype F31"),
        (r#"{"dtype":"F32","shape":[4],"data_offsets":[8,40]}"#, "not a range within"),
    ] {
        let err = header_of(entry);
        assert!(err.contains("lying.safetensors") && err.contains("key a.weight") && err.contains(says), "{err}");
    }
}

#[test]
fn damaged_png_and_jpeg_images_are_errors_naming_the_file() {
    let dir = suite_tests::scratch("data-damaged", "img");
    let img = image::RgbImage::from_fn(24, 16, |x, y| image::Rgb([(x * 10) as u8, (y * 15) as u8, 99]));
    for ext in ["png", "jpg"] {
        let good = dir.join(format!("good.{ext}"));
        img.save(&good).unwrap();
        let bytes = std::fs::read(&good).unwrap();
        let errors = mutate(&bytes, &dir.join(format!("photo.{ext}")), 200, |p| {
            let decoded = data::folder::decode(p, 3).map_err(|e| e.to_string())?;
            assert!(decoded.pixels.iter().all(|v| (0.0..=1.0).contains(v)));
            Ok(())
        });
        assert!(errors >= 50, "{ext}: {errors} of 200 damaged files were errors");
    }
}

#[test]
fn damaged_hdf5_image_sets_are_errors_naming_the_file() {
    let dir = suite_tests::scratch("data-damaged", "h5");
    let folder = dir.join("imgs");
    for (class, base) in [("a", 20u8), ("b", 200u8)] {
        std::fs::create_dir_all(folder.join(class)).unwrap();
        for i in 0..3u8 {
            let img = image::RgbImage::from_fn(6, 6, |x, _| image::Rgb([base + i, base + x as u8, base]));
            img.save(folder.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    let good = dir.join("good.h5");
    data::h5::convert_folder(&folder, &good, 6, 3).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let errors = mutate(&bytes, &dir.join("set.h5"), 200, |p| {
        let set = data::Hdf5Images::open(p).map_err(|e| e.to_string())?;
        for i in 0..set.len() {
            set.get(i).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    assert!(errors >= 100, "{errors} of 200 damaged files were errors");
}

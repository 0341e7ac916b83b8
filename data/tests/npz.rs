//! The checked `.npz` reader: arrays of every supported dtype round-trip, and damaged files —
//! truncated, bit-flipped, or with a `.npy` header edited and re-zipped with valid checksums —
//! give an error naming the file, never a panic or a silent load past the data.
use std::io::Write;
use std::path::Path;

mod support;

use support::Lcg;

use data::npz;
use tch::{Device, Kind, Tensor};

/// A `.npy` file: header dict `header`, then `data`.
fn npy(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

/// Writes entries into a zip archive (deflated, with valid checksums).
fn zip_file(path: &Path, entries: &[(&str, Vec<u8>)]) {
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    for (name, bytes) in entries {
        zip.start_file(format!("{name}.npy"), zip::write::FileOptions::default()).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

fn arrays() -> Vec<(String, Tensor)> {
    let f = |k| (Kind::Float, k);
    vec![
        ("w".into(), Tensor::arange(12, f(Device::Cpu)).view([3, 4]) / 7.0),
        ("d".into(), Tensor::arange(5, (Kind::Double, Device::Cpu)) * 0.5),
        ("i".into(), Tensor::arange(6, (Kind::Int, Device::Cpu)).view([2, 3]) - 2),
        ("l".into(), Tensor::arange(4, (Kind::Int64, Device::Cpu))),
        ("u".into(), Tensor::from_slice(&[1u8, 200, 3])),
        ("h".into(), Tensor::arange(3, f(Device::Cpu)).to_kind(Kind::Half)),
        ("s".into(), Tensor::from(2.5f32)),
    ]
}

#[test]
fn arrays_of_every_supported_dtype_round_trip_and_match_tch() {
    let dir = suite_tests::scratch("data-npz", "roundtrip");
    let path = dir.join("a.npz");
    let want = arrays();
    data::checkpoint::save_npz(&want, &path).unwrap();
    let got = npz::read(&path).unwrap();
    let tch_read = Tensor::read_npz(&path).unwrap();
    assert_eq!(got.len(), want.len());
    for (((name, t), (n2, w)), (n3, r)) in got.iter().zip(&want).zip(&tch_read) {
        assert!(name == n2 && name == n3);
        assert_eq!((t.kind(), t.size()), (w.kind(), w.size()), "{name}");
        assert!(t.equal(w) && t.equal(r), "{name}");
    }
    // Big-endian data (NumPy writes it for '>' dtypes) is converted.
    let be: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_be_bytes()).collect();
    let path = dir.join("be.npz");
    zip_file(&path, &[("x", npy("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", &be))]);
    assert!(npz::read(&path).unwrap()[0].1.equal(&Tensor::from_slice(&[1.5f32, -2.0])));
    // Booleans (tch does not write them; NumPy does, one byte each).
    zip_file(&path, &[("m", npy("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", &[1, 0, 1]))]);
    assert!(npz::read(&path).unwrap()[0].1.equal(&Tensor::from_slice(&[true, false, true])));
}

#[test]
fn a_header_declaring_more_data_than_the_entry_holds_is_named() {
    let dir = suite_tests::scratch("data-npz", "short");
    let path = dir.join("short.npz");
    let data: Vec<u8> = (0..6).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000, 1000), }";
    zip_file(&path, &[("params//weights", npy(header, &data))]);
    let err = npz::read(&path).unwrap_err().to_string();
    assert!(err.contains("short.npz") && err.contains("params//weights") && err.contains("[1000, 1000]"), "{err}");
    for (header, what) in [
        ("{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }", "dtype"),
        ("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", "Fortran"),
        ("{'descr': '<f4', 'shape': (6,), }", "fortran_order"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (-6,), }", "shape entry"),
    ] {
        zip_file(&path, &[("a", npy(header, &data))]);
        let err = npz::read(&path).unwrap_err().to_string();
        assert!(err.contains("array a") && err.contains(what), "{header}: {err}");
    }
}

#[test]
fn hundreds_of_damaged_files_are_errors_not_panics() {
    let dir = suite_tests::scratch("data-npz", "mutants");
    let good = dir.join("good.npz");
    data::checkpoint::save_npz(&arrays(), &good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let entries: Vec<(String, Vec<u8>)> = {
        let mut zip = zip::ZipArchive::new(std::fs::File::open(&good).unwrap()).unwrap();
        (0..zip.len())
            .map(|i| {
                let mut e = zip.by_index(i).unwrap();
                let mut v = vec![];
                std::io::Read::read_to_end(&mut e, &mut v).unwrap();
                (e.name().trim_end_matches(".npy").to_string(), v)
            })
            .collect()
    };
    let mut rng = Lcg(7);
    let (mut errors, mut loaded) = (0, 0);
    let path = dir.join("mutant.npz");
    for round in 0..300 {
        match round % 3 {
            // Truncated anywhere.
            0 => std::fs::write(&path, &bytes[..rng.below(bytes.len())]).unwrap(),
            // One bit flipped anywhere (the zip layer's checksums catch most).
            1 => {
                let mut b = bytes.clone();
                let at = rng.below(b.len());
                b[at] ^= 1 << rng.below(8);
                std::fs::write(&path, &b).unwrap();
            }
            // A byte of a .npy header or data edited, then re-zipped with valid checksums.
            _ => {
                let mut edited = entries.clone();
                let (_, npy) = &mut edited[rng.below(entries.len())];
                let at = rng.below(npy.len().min(128));
                npy[at] = b"0123456789(),' <>fiub"[rng.below(21)];
                let refs: Vec<(&str, Vec<u8>)> = edited.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
                zip_file(&path, &refs);
            }
        }
        let result = std::panic::catch_unwind(|| npz::read(&path));
        match result.expect("reading a damaged file must not panic") {
            Ok(arrays) => {
                // What loads must be whole: every array's bytes are its declared size.
                loaded += 1;
                assert!(arrays.iter().all(|(_, t)| t.numel() < 1 << 20));
            }
            Err(e) => {
                errors += 1;
                assert!(e.to_string().contains("mutant.npz"), "{e}");
            }
        }
    }
    assert!(errors > 200, "only {errors} of 300 damaged files were errors ({loaded} loaded)");
}

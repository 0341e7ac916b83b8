//! TensorBoard event files, written as TensorFlow's `EventFileWriter` writes them (and PyTorch's
//! `SummaryWriter`, which diffusers' scripts use through accelerate): a file
//! `events.out.tfevents.<seconds>.<host>.<pid>.<n>` of TFRecord records, each an `Event`
//! protocol buffer (`tensorboard/compat/proto/event.proto`, `summary.proto`): the first names
//! the format (`file_version: "brain.Event:2"`), the others carry a step's scalars
//! (`summary.value[].simple_value`) or an image (`summary.value[].image`, a PNG).
//!
//! TFRecord framing: the data's length as a little-endian u64, the masked CRC-32C of those 8
//! bytes, the data, the masked CRC-32C of the data. The few protobuf fields are encoded here by
//! hand.
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{Error, Result};

/// CRC-32C (Castagnoli), the checksum TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !data.iter().fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// TFRecord's masked CRC: rotated right by 15 bits plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord record around `data`.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// The protobuf encoding of the few fields an event needs.
mod proto {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
        varint(out, ((field as u64) << 3) | wire as u64);
    }

    /// An int32, int64 or enum field (wire type 0; negative values as ten bytes).
    pub fn int(out: &mut Vec<u8>, field: u32, v: i64) {
        key(out, field, 0);
        varint(out, v as u64);
    }

    /// A double (wire type 1).
    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }

    /// A float (wire type 5).
    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }

    /// A string, bytes or embedded message (wire type 2).
    pub fn bytes(out: &mut Vec<u8>, field: u32, v: &[u8]) {
        key(out, field, 2);
        varint(out, v.len() as u64);
        out.extend_from_slice(v);
    }
}

/// `Event` fields (event.proto).
const EVENT_WALL_TIME: u32 = 1;
const EVENT_STEP: u32 = 2;
const EVENT_FILE_VERSION: u32 = 3;
const EVENT_SUMMARY: u32 = 5;
const EVENT_SESSION_LOG: u32 = 7;
/// `SessionLog.status` and its `START`.
const SESSION_LOG_STATUS: u32 = 1;
const SESSION_START: i64 = 1;
/// `Summary.value`, and `Summary.Value` fields (summary.proto).
const SUMMARY_VALUE: u32 = 1;
const VALUE_TAG: u32 = 1;
const VALUE_SIMPLE_VALUE: u32 = 2;
const VALUE_IMAGE: u32 = 4;
/// `Summary.Image` fields.
const IMAGE_HEIGHT: u32 = 1;
const IMAGE_WIDTH: u32 = 2;
const IMAGE_COLORSPACE: u32 = 3;
const IMAGE_ENCODED: u32 = 4;

/// What one summary value holds.
pub enum Value<'a> {
    /// A number (`simple_value`, a float).
    Scalar(f64),
    /// An encoded image (PNG) of `height` x `width` pixels of `channels` (1 grey, 3 RGB, 4 RGBA).
    Image {
        /// Pixels down.
        height: u32,
        /// Pixels across.
        width: u32,
        /// TensorBoard's colour space: the channel count.
        channels: u32,
        /// The image file's bytes.
        png: &'a [u8],
    },
}

/// An `Event` at `step`, `wall_time` seconds since the epoch, whose content `what` encodes
/// as field `field`.
fn event(wall_time: f64, step: i64, field: u32, what: &[u8]) -> Vec<u8> {
    let mut e = Vec::with_capacity(what.len() + 24);
    proto::double(&mut e, EVENT_WALL_TIME, wall_time);
    proto::int(&mut e, EVENT_STEP, step);
    proto::bytes(&mut e, field, what);
    e
}

/// The `Summary` of `values` by tag.
fn summary(values: &[(&str, Value)]) -> Vec<u8> {
    let mut s = Vec::new();
    for (tag, value) in values {
        let mut v = Vec::new();
        proto::bytes(&mut v, VALUE_TAG, tag.as_bytes());
        match value {
            Value::Scalar(x) => proto::float(&mut v, VALUE_SIMPLE_VALUE, *x as f32),
            Value::Image { height, width, channels, png } => {
                let mut image = Vec::with_capacity(png.len() + 16);
                proto::int(&mut image, IMAGE_HEIGHT, *height as i64);
                proto::int(&mut image, IMAGE_WIDTH, *width as i64);
                proto::int(&mut image, IMAGE_COLORSPACE, *channels as i64);
                proto::bytes(&mut image, IMAGE_ENCODED, png);
                proto::bytes(&mut v, VALUE_IMAGE, &image);
            }
        }
        proto::bytes(&mut s, SUMMARY_VALUE, &v);
    }
    s
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name, as the event file's name carries it (`socket.gethostname()`).
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = if ok { String::from_utf8_lossy(&buf[..end]).into_owned() } else { String::new() };
    // A name that would make a path of several parts (or none) is not used.
    match name.is_empty() || name.contains('/') {
        true => "localhost".into(),
        false => name,
    }
}

/// An event file being written. Each [`EventWriter::write`] is flushed to the file at once, so
/// a job that dies loses no step it logged.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `dir` (created with its parents), its first record the format's
    /// version. `resumed_after`: the step of the checkpoint a resumed run starts from; a
    /// `SessionLog` START at the next step then tells TensorBoard to drop what earlier files
    /// logged after the checkpoint (as TensorFlow's supervisor writes on restart), so the
    /// curves read as one run.
    pub fn create(dir: &Path, resumed_after: Option<usize>) -> Result<EventWriter> {
        let io = |what: &Path| {
            let what = what.display().to_string();
            move |e| Error::io(format!("TensorBoard log {what}"), e)
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let wall = now();
        let name = format!("events.out.tfevents.{:010}.{}.{}", wall as u64, hostname(), std::process::id());
        // A second writer of this process in the same second gets the next number.
        let (path, file) = (0..)
            .map(|n| dir.join(format!("{name}.{n}")))
            .find_map(|p| match File::options().write(true).create_new(true).open(&p) {
                Ok(f) => Some(Ok((p, f))),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
                Err(e) => Some(Err(io(&p)(e))),
            })
            .unwrap_or_else(|| unreachable!("an unbounded search ends"))?;
        let mut writer = EventWriter { path, file: BufWriter::new(file) };
        writer.append(&event(wall, 0, EVENT_FILE_VERSION, b"brain.Event:2"))?;
        if let Some(step) = resumed_after {
            let mut start = Vec::new();
            proto::int(&mut start, SESSION_LOG_STATUS, SESSION_START);
            writer.append(&event(wall, step as i64 + 1, EVENT_SESSION_LOG, &start))?;
        }
        writer.flush()?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&mut self, event: &[u8]) -> Result<()> {
        let path = &self.path;
        self.file.write_all(&record(event)).map_err(|e| Error::io(format!("TensorBoard log {}", path.display()), e))
    }

    fn flush(&mut self) -> Result<()> {
        let path = &self.path;
        self.file.flush().map_err(|e| Error::io(format!("TensorBoard log {}", path.display()), e))
    }

    /// Logs `values` at `step`, one event, and flushes it. Scalars that are not finite are
    /// written as they are (TensorBoard shows NaN and infinities).
    pub fn write(&mut self, step: usize, values: &[(&str, Value)]) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.append(&event(now(), step as i64, EVENT_SUMMARY, &summary(values)))?;
        self.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_the_record_framing_are_tfrecords() {
        // The standard check value, and RFC 3720's 32 zero bytes.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        let unmask = |m: u32| m.wrapping_sub(0xa282_ead8).rotate_left(15);
        assert_eq!(unmask(u32::from_le_bytes(r[8..12].try_into().unwrap())), crc32c(&r[..8]));
        assert_eq!(unmask(u32::from_le_bytes(r[15..19].try_into().unwrap())), crc32c(b"abc"));
    }

    #[test]
    fn events_are_protobuf_as_tensorflow_encodes_them() {
        // A scalar event, bytes as protobuf's Python encoder gives them for
        // Event(wall_time=1.5, step=300, summary=Summary(value=[Value(tag="a", simple_value=2)])).
        let e = event(1.5, 300, EVENT_SUMMARY, &summary(&[("a", Value::Scalar(2.0))]));
        let want = [
            0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, // wall_time
            0x10, 0xac, 0x02, // step 300
            0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15, 0, 0, 0, 0x40, // summary
        ];
        assert_eq!(e, want);
    }

    #[test]
    fn a_writer_starts_with_the_version_and_flushes_each_step() {
        let dir = std::env::temp_dir().join(format!("engine-tensorboard-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = EventWriter::create(&dir.join("run"), Some(4)).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents.") && name.ends_with(&format!(".{}.0", std::process::id())));
        let before = std::fs::metadata(w.path()).unwrap().len();
        w.write(5, &[("loss", Value::Scalar(0.5))]).unwrap();
        // On disk before the writer is dropped: a crash loses nothing logged.
        let bytes = std::fs::read(w.path()).unwrap();
        assert!(bytes.len() as u64 > before);
        let first_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert!(bytes[12..12 + first_len].windows(13).any(|w| w == b"brain.Event:2"));
        let second = EventWriter::create(&dir.join("run"), None).unwrap();
        assert_ne!(second.path(), w.path(), "two writers in one second get two files");
        let err = EventWriter::create(&dir.join("run").join(&name), None).err().unwrap().to_string();
        assert!(err.contains(&name), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

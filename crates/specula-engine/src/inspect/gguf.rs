//! A bounds-checked GGUF header reader (format: ggml's `docs/gguf.md`): the metadata key/values
//! and the tensor directory, in file order, without reading any tensor data.
//!
//! candle's `gguf_file::Content::read` reads the same header, but keeps tensor infos in a map
//! (a duplicate name silently replaces the first), rejects an unknown tensor type without naming
//! the tensor, and divides by `general.alignment` unchecked. This reader names the byte offset,
//! key or tensor of every problem, never allocates more than the file could hold, and never
//! panics; [`validate`] then checks the directory against the file (duplicates, types, data
//! ranges past the end of the file).

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read};
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::GgmlDType;

/// Deepest nesting of arrays accepted in metadata.
const MAX_DEPTH: usize = 8;
/// Most dimensions of a tensor (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape, outermost first (`[rows, columns]` for a matrix: ggml's `ne` reversed, the same
    /// order as candle and Hugging Face use).
    pub dims: Vec<usize>,
    /// The raw ggml type id.
    pub type_id: u32,
    /// The type, when it is one candle can hold (`None` for an unknown id).
    pub dtype: Option<GgmlDType>,
    /// Offset of the tensor's data from the start of the data section, in bytes.
    pub offset: u64,
}

impl GgufTensor {
    /// Number of elements (saturating; a product that overflows is reported by [`validate`]).
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
    }

    /// Bytes of data, when the type is known and the element count fills whole blocks.
    pub fn data_bytes(&self) -> Option<u64> {
        let dt = self.dtype?;
        let n = self.elements();
        let bs = dt.block_size() as u64;
        // Saturating: an absurd shape gives a size past any file, which [`validate`] reports.
        n.is_multiple_of(bs)
            .then(|| (n / bs).saturating_mul(dt.type_size() as u64))
    }
}

/// A GGUF file's header.
#[derive(Debug, Clone)]
pub struct GgufScan {
    /// Format version (1, 2 or 3).
    pub version: u32,
    /// Metadata, by key.
    pub metadata: HashMap<String, Value>,
    /// Tensor directory, in file order (duplicates kept).
    pub tensors: Vec<GgufTensor>,
    /// Alignment of the data section (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// File size in bytes.
    pub file_len: u64,
}

/// The name of a ggml type id (llama.cpp's `ggml_type` numbering).
pub fn type_name(id: u32) -> String {
    let s = match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        other => return format!("type {other}"),
    };
    s.to_string()
}

/// The candle type of a ggml type id, for the types candle can hold.
pub fn dtype_of(id: u32) -> Option<GgmlDType> {
    Some(match id {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// The display name of a candle ggml type ("Q4_K", as llama.cpp names it).
pub fn dtype_name(dt: GgmlDType) -> String {
    let s = format!("{dt:?}");
    match s.strip_suffix('K') {
        Some(p) if p.starts_with('Q') => format!("{p}_K"),
        _ => s,
    }
}

struct Reader<R> {
    inner: R,
    pos: u64,
    len: u64,
    version: u32,
    file: String,
}

impl<R: Read> Reader<R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.remaining() {
            bail!(
                "{}: {what} needs {n} bytes at offset {}, but the file ends after {} more (truncated header?)",
                self.file,
                self.pos,
                self.remaining()
            );
        }
        let mut v = vec![0u8; n as usize];
        self.inner
            .read_exact(&mut v)
            .map_err(|e| anyhow!("{}: reading {what} at offset {}: {e}", self.file, self.pos))?;
        self.pos += n;
        Ok(v)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(&v);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length or count: u32 in version 1, u64 after.
    fn len_prefix(&mut self, what: &str) -> Result<u64> {
        if self.version == 1 {
            Ok(u64::from(self.u32(what)?))
        } else {
            self.u64(what)
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let n = self.len_prefix(what)?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b).map_err(|_| anyhow!("{}: {what} at offset {at} is not valid UTF-8", self.file))
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("metadata '{key}'");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => Value::Bool(self.array::<1>(&what)?[0] != 0),
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    bail!("{}: {what}: arrays nested deeper than {MAX_DEPTH}", self.file);
                }
                let elem_ty = self.u32(&what)?;
                let n = self.len_prefix(&what)?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    8 => {
                        if self.version == 1 {
                            4
                        } else {
                            8
                        }
                    }
                    // An array: its element type and length (u32 + u32 in version 1).
                    9 => {
                        if self.version == 1 {
                            8
                        } else {
                            12
                        }
                    }
                    other => bail!(
                        "{}: {what}: array of unknown value type {other} at offset {}",
                        self.file,
                        self.pos
                    ),
                };
                if n.saturating_mul(min) > self.remaining() {
                    bail!(
                        "{}: {what}: an array of {n} elements cannot fit in the {} bytes left in the file (truncated header?)",
                        self.file,
                        self.remaining()
                    );
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            other => bail!(
                "{}: {what} has unknown value type {other} (offset {})",
                self.file,
                self.pos
            ),
        })
    }
}

/// Read the header of a GGUF file: magic, version, metadata and tensor directory. Reads no
/// tensor data. Errors name the file, the byte offset and the key or tensor being read.
pub fn scan(path: &Path) -> Result<GgufScan> {
    let file = path.display().to_string();
    let f = crate::bundle::open_file(path).map_err(|e| anyhow!("{file}: {e}"))?;
    let len = f.metadata().map_err(|e| anyhow!("{file}: {e}"))?.len();
    scan_reader(BufReader::with_capacity(1 << 16, f), len, &file)
}

/// [`scan`] over any reader positioned at the start of a GGUF file of `len` bytes (`file`
/// names it in errors): the same reading and checks, for a file already in memory (and for the
/// fuzz targets in `fuzz/`).
pub fn scan_reader<R: Read>(inner: R, len: u64, file: &str) -> Result<GgufScan> {
    let file = file.to_string();
    let mut r = Reader {
        inner,
        pos: 0,
        len,
        version: 3,
        file: file.clone(),
    };
    let magic = r.array::<4>("the GGUF magic")?;
    if &magic != b"GGUF" {
        bail!("{file}: not a GGUF file (magic {magic:02x?}, expected \"GGUF\")");
    }
    let version = r.u32("the GGUF version")?;
    if !(1..=3).contains(&version) {
        bail!("{file}: GGUF version {version} is not supported (1, 2 or 3)");
    }
    r.version = version;
    let n_tensors = r.len_prefix("the tensor count")?;
    let n_kv = r.len_prefix("the metadata count")?;
    // Each key/value needs at least 13 bytes and each tensor info at least 24.
    let min = n_kv.saturating_mul(13).saturating_add(n_tensors.saturating_mul(24));
    if min > r.remaining() {
        bail!(
            "{file}: the header declares {n_tensors} tensors and {n_kv} metadata entries, which cannot fit in the {} bytes left (truncated header?)",
            r.remaining()
        );
    }
    let mut metadata = HashMap::new();
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key #{i}"))?;
        let ty = r.u32(&format!("the type of metadata '{key}'"))?;
        let v = r.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), v).is_some() {
            bail!("{file}: metadata key '{key}' appears twice");
        }
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = r.string(&format!("the name of tensor #{i}"))?;
        let what = format!("tensor '{name}'");
        let n_dims = r.u32(&what)?;
        if n_dims > MAX_DIMS {
            bail!("{file}: tensor '{name}' has {n_dims} dimensions (at most {MAX_DIMS})");
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = if version == 1 {
                u64::from(r.u32(&what)?)
            } else {
                r.u64(&what)?
            };
            ne.push(usize::try_from(d).map_err(|_| anyhow!("{file}: tensor '{name}': dimension {d} is too large"))?);
        }
        ne.reverse();
        let type_id = r.u32(&what)?;
        let offset = r.u64(&what)?;
        tensors.push(GgufTensor {
            name,
            dims: ne,
            type_id,
            dtype: dtype_of(type_id),
            offset,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => 32,
        Some(v) => {
            let a = match v {
                Value::U8(x) => u64::from(*x),
                Value::U16(x) => u64::from(*x),
                Value::U32(x) => u64::from(*x),
                Value::U64(x) => *x,
                Value::I32(x) => u64::try_from(*x).unwrap_or(0),
                _ => 0,
            };
            if a == 0 || !a.is_power_of_two() {
                bail!("{file}: metadata 'general.alignment' = {v:?} is not a positive power of two");
            }
            a
        }
    };
    let data_offset = r.pos.div_ceil(alignment).saturating_mul(alignment);
    Ok(GgufScan {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
        file_len: len,
    })
}

impl GgufScan {
    /// The header as candle's `gguf_file::Content` (for reading tensors with candle). Tensors of
    /// unknown type are left out (see [`validate`]); of duplicate names, the first is kept.
    pub fn into_content(self) -> gguf_file::Content {
        let mut tensor_infos = HashMap::with_capacity(self.tensors.len());
        for t in self.tensors {
            if let Some(dt) = t.dtype {
                tensor_infos.entry(t.name).or_insert(gguf_file::TensorInfo {
                    ggml_dtype: dt,
                    shape: candle_core::Shape::from(t.dims),
                    offset: t.offset,
                });
            }
        }
        gguf_file::Content {
            magic: match self.version {
                1 => gguf_file::VersionedMagic::GgufV1,
                2 => gguf_file::VersionedMagic::GgufV2,
                _ => gguf_file::VersionedMagic::GgufV3,
            },
            metadata: self.metadata,
            tensor_infos,
            tensor_data_offset: self.data_offset,
        }
    }
}

/// A problem found in a GGUF tensor directory: the tensor's name and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorProblem {
    pub tensor: String,
    pub message: String,
    /// Loading fails (every problem found today; the field leaves room for warnings).
    pub fatal: bool,
}

/// Check the tensor directory against the file: duplicate names, unknown types, element counts
/// that do not fill whole blocks, misaligned offsets and data ranges past the end of the file.
pub fn validate(scan: &GgufScan) -> Vec<TensorProblem> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for t in &scan.tensors {
        let mut bad = |message: String| {
            out.push(TensorProblem {
                tensor: t.name.clone(),
                message,
                fatal: true,
            })
        };
        if !seen.insert(t.name.as_str()) {
            bad("appears more than once in the tensor directory (duplicate tensor)".into());
            continue;
        }
        if t.dims.contains(&0) {
            bad(format!("has an empty dimension (shape {:?})", t.dims));
            continue;
        }
        let Some(dt) = t.dtype else {
            bad(format!(
                "has tensor type {} ({}), which this build cannot load",
                t.type_id,
                type_name(t.type_id)
            ));
            continue;
        };
        let n = t
            .dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .unwrap_or(u64::MAX);
        let bs = dt.block_size() as u64;
        if !n.is_multiple_of(bs) {
            bad(format!(
                "has {n} elements (shape {:?}), not a multiple of the {} block size {bs}",
                t.dims,
                dtype_name(dt)
            ));
            continue;
        }
        if !t.offset.is_multiple_of(scan.alignment) {
            // The format requires every tensor's data to start on the alignment.
            bad(format!(
                "data offset {} is not a multiple of the alignment {} (general.alignment)",
                t.offset, scan.alignment
            ));
            continue;
        }
        // Saturating, not wrapping: a huge shape must not come out as a small size that fits.
        let bytes = (n / bs).saturating_mul(dt.type_size() as u64);
        let start = scan.data_offset.saturating_add(t.offset);
        let end = start.saturating_add(bytes);
        if end > scan.file_len {
            bad(format!(
                "data [{start}, {end}) ends past the end of the file ({} bytes): truncated file or bad offset",
                scan.file_len
            ));
        }
    }
    out
}

/// A metadata value as a float (f32 or f64).
pub fn meta_f64(md: &HashMap<String, Value>, key: &str) -> Option<f64> {
    let v = md.get(key)?;
    v.to_f32().ok().map(f64::from).or_else(|| v.to_f64().ok())
}

/// A metadata value as an unsigned integer (any integer width).
pub fn meta_usize(md: &HashMap<String, Value>, key: &str) -> Option<usize> {
    match md.get(key)? {
        Value::U8(x) => Some(usize::from(*x)),
        Value::U16(x) => Some(usize::from(*x)),
        Value::U32(x) => usize::try_from(*x).ok(),
        Value::U64(x) => usize::try_from(*x).ok(),
        Value::I8(x) => usize::try_from(*x).ok(),
        Value::I16(x) => usize::try_from(*x).ok(),
        Value::I32(x) => usize::try_from(*x).ok(),
        Value::I64(x) => usize::try_from(*x).ok(),
        _ => None,
    }
}

/// A metadata value as a string.
pub fn meta_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    match md.get(key)? {
        Value::String(s) => Some(s.as_str()),
        _ => None,
    }
}

/// A metadata array's length.
pub fn meta_array_len(md: &HashMap<String, Value>, key: &str) -> Option<usize> {
    match md.get(key)? {
        Value::Array(a) => Some(a.len()),
        _ => None,
    }
}

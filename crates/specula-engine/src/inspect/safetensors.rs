//! A bounds-checked safetensors header reader (format: huggingface/safetensors `README.md`):
//! an 8-byte little-endian header length, then that many bytes of JSON naming each tensor's
//! dtype, shape and `data_offsets` (relative to the end of the header). Only the header is read.
//!
//! Duplicate tensor names (which a JSON map would silently collapse), unknown dtypes, sizes that
//! disagree with shape × dtype, and data ranges past the end of the file are reported per tensor
//! by [`validate`].

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use anyhow::{anyhow, bail, Result};
use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value as Json;

/// Largest header accepted (the reference implementation's limit is 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a safetensors header.
#[derive(Debug, Clone)]
pub struct StTensor {
    pub name: String,
    /// The dtype string as written (`F32`, `BF16`, ...).
    pub dtype: String,
    /// Shape, outermost first.
    pub dims: Vec<usize>,
    /// `[begin, end)` byte range relative to the data section.
    pub data_offsets: (u64, u64),
}

impl StTensor {
    pub fn elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64))
    }
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
pub struct StScan {
    /// Tensors in header order (duplicates kept).
    pub tensors: Vec<StTensor>,
    /// Tensor entries that could not be read (name, problem), e.g. a missing `shape`.
    pub malformed: Vec<(String, String)>,
    /// Byte length of the JSON header.
    pub header_len: u64,
    /// File size in bytes.
    pub file_len: u64,
}

impl StScan {
    /// Absolute offset of the data section.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }
}

/// Bytes per element of a safetensors dtype, `None` for an unknown one.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// The JSON object's entries in order, duplicates kept.
struct Entries(Vec<(String, Json)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Json>()? {
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn parse_entry(name: &str, v: &Json) -> std::result::Result<StTensor, String> {
    let o = v.as_object().ok_or("is not a JSON object")?;
    let dtype = o
        .get("dtype")
        .and_then(Json::as_str)
        .ok_or("has no string field 'dtype'")?
        .to_string();
    let dims = o
        .get("shape")
        .and_then(Json::as_array)
        .ok_or("has no array field 'shape'")?
        .iter()
        .map(|d| d.as_u64().and_then(|x| usize::try_from(x).ok()))
        .collect::<Option<Vec<usize>>>()
        .ok_or("field 'shape' holds a non-integer")?;
    let offs = o
        .get("data_offsets")
        .and_then(Json::as_array)
        .ok_or("has no array field 'data_offsets'")?;
    let (b, e) = match offs.as_slice() {
        [b, e] => (
            b.as_u64().ok_or("field 'data_offsets' holds a non-integer")?,
            e.as_u64().ok_or("field 'data_offsets' holds a non-integer")?,
        ),
        _ => return Err("field 'data_offsets' is not [begin, end]".into()),
    };
    Ok(StTensor {
        name: name.to_string(),
        dtype,
        dims,
        data_offsets: (b, e),
    })
}

/// Read a safetensors file's header (8-byte length + JSON). Reads no tensor data. Errors name
/// the file and what is wrong (truncated length, header longer than the file, bad JSON).
pub fn scan(path: &Path) -> Result<StScan> {
    let file = path.display().to_string();
    let f = crate::bundle::open_file(path).map_err(|e| anyhow!("{file}: {e}"))?;
    let file_len = f.metadata().map_err(|e| anyhow!("{file}: {e}"))?.len();
    scan_reader(f, file_len, &file)
}

/// [`scan`] over any reader positioned at the start of a safetensors file of `file_len` bytes
/// (`file` names it in errors): the same reading and checks, for a file already in memory (and
/// for the fuzz targets in `fuzz/`).
pub fn scan_reader<R: Read>(mut f: R, file_len: u64, file: &str) -> Result<StScan> {
    if file_len < 8 {
        bail!("{file}: {file_len} bytes, too short for the 8-byte safetensors header length (truncated file)");
    }
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| anyhow!("{file}: {e}"))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_BYTES {
        bail!("{file}: the header length field says {header_len} bytes (more than {MAX_HEADER_BYTES}): not a safetensors file, or a corrupt one");
    }
    if header_len > file_len - 8 {
        bail!(
            "{file}: the header length field says {header_len} bytes, but only {} follow (truncated header)",
            file_len - 8
        );
    }
    let mut buf = vec![0u8; header_len as usize];
    f.read_exact(&mut buf)
        .map_err(|e| anyhow!("{file}: reading the header: {e}"))?;
    let text = std::str::from_utf8(&buf).map_err(|e| anyhow!("{file}: the header is not UTF-8: {e}"))?;
    let entries: Entries = serde_json::from_str(text.trim_end_matches([' ', '\0']))
        .map_err(|e| anyhow!("{file}: the header is not a JSON object: {e}"))?;
    let mut tensors = Vec::new();
    let mut malformed = Vec::new();
    for (k, v) in entries.0 {
        if k == "__metadata__" {
            continue;
        }
        match parse_entry(&k, &v) {
            Ok(t) => tensors.push(t),
            Err(m) => malformed.push((k, m)),
        }
    }
    Ok(StScan {
        tensors,
        malformed,
        header_len,
        file_len,
    })
}

/// A problem with one tensor of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorProblem {
    pub tensor: String,
    pub message: String,
}

/// Check a header's tensors against the file: malformed entries, duplicates, unknown dtypes,
/// `data_offsets` that disagree with shape × dtype size, and ranges past the end of the file.
pub fn validate(scan: &StScan) -> Vec<TensorProblem> {
    let mut out: Vec<TensorProblem> = scan
        .malformed
        .iter()
        .map(|(t, m)| TensorProblem {
            tensor: t.clone(),
            message: m.clone(),
        })
        .collect();
    let data_len = scan.file_len.saturating_sub(scan.data_start());
    let mut seen = HashSet::new();
    for t in &scan.tensors {
        let mut bad = |message: String| {
            out.push(TensorProblem {
                tensor: t.name.clone(),
                message,
            })
        };
        if !seen.insert(t.name.as_str()) {
            bad("appears more than once in the header (duplicate tensor)".into());
            continue;
        }
        let Some(size) = dtype_size(&t.dtype) else {
            bad(format!("has unknown dtype '{}'", t.dtype));
            continue;
        };
        let (b, e) = t.data_offsets;
        if e < b {
            bad(format!("data_offsets [{b}, {e}] end before they begin"));
            continue;
        }
        let want = t.elements().saturating_mul(size);
        if e - b != want {
            bad(format!(
                "data_offsets [{b}, {e}] hold {} bytes, but shape {:?} of {} needs {want}",
                e - b,
                t.dims,
                t.dtype
            ));
        }
        if e > data_len {
            bad(format!(
                "data_offsets [{b}, {e}] end past the end of the file (the data section has {data_len} bytes): truncated file or bad offset"
            ));
        }
    }
    out
}

/// One expert's projection inside a fused expert tensor ([`split_fused_experts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedSlice {
    /// The per-expert name it stands for (`….experts.3.gate_proj.weight`).
    pub name: String,
    /// The expert: the index along the fused tensor's first dimension.
    pub expert: usize,
    /// Its rows within that expert's `[rows, in]` matrix.
    pub rows: std::ops::Range<usize>,
    /// Its shape, `[rows, in]`.
    pub dims: Vec<usize>,
}

/// transformers 5's fused layout of an MoE layer's experts, as the per-expert tensors of
/// the Hub layout it stands for: `P.experts.gate_up_proj` `[experts, 2 × inter, hidden]` is each
/// expert's `P.experts.N.gate_proj.weight` (the first `inter` rows) and `up_proj.weight` (the
/// rest); `P.experts.down_proj` `[experts, hidden, inter]` is each expert's `down_proj.weight`.
/// `Ok(None)` for any other name; an error naming the shape for a fused name whose shape is not
/// one (not 3-D, or an odd gate/up row count). (transformers 5 fuses the experts in memory and
/// writes the Hub layout back; a bundle saved fused is read the same way.)
pub fn split_fused_experts(name: &str, dims: &[usize]) -> std::result::Result<Option<Vec<FusedSlice>>, String> {
    let Some((prefix, which)) = name.rsplit_once(".experts.") else {
        return Ok(None);
    };
    if !matches!(which, "gate_up_proj" | "down_proj") {
        return Ok(None);
    }
    if dims.len() != 3 {
        return Err(format!(
            "has shape {dims:?}: a fused expert tensor is [experts, out, in]"
        ));
    }
    let (n, rows, cols) = (dims[0], dims[1], dims[2]);
    let parts: Vec<(&str, std::ops::Range<usize>)> = match which {
        "gate_up_proj" if rows.is_multiple_of(2) => vec![("gate_proj", 0..rows / 2), ("up_proj", rows / 2..rows)],
        "gate_up_proj" => {
            return Err(format!(
                "has shape {dims:?}: the gate and up rows of each expert are 2 × moe_intermediate_size, an even count"
            ))
        }
        _ => vec![("down_proj", 0..rows)],
    };
    let mut out = Vec::with_capacity(n * parts.len());
    for e in 0..n {
        for (proj, r) in &parts {
            out.push(FusedSlice {
                name: format!("{prefix}.experts.{e}.{proj}.weight"),
                expert: e,
                rows: r.clone(),
                dims: vec![r.len(), cols],
            });
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod fused_tests {
    use super::*;

    #[test]
    fn fused_experts_split_into_the_hub_layout_names() {
        let s = split_fused_experts("model.layers.2.mlp.experts.gate_up_proj", &[2, 8, 5])
            .expect("a fused shape")
            .expect("fused");
        let names: Vec<&str> = s.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.2.mlp.experts.0.gate_proj.weight",
                "model.layers.2.mlp.experts.0.up_proj.weight",
                "model.layers.2.mlp.experts.1.gate_proj.weight",
                "model.layers.2.mlp.experts.1.up_proj.weight",
            ]
        );
        assert_eq!(
            (s[1].rows.clone(), s[1].dims.clone(), s[3].expert),
            (4..8, vec![4, 5], 1)
        );
        let d = split_fused_experts("model.layers.0.mlp.experts.down_proj", &[3, 5, 4])
            .expect("a fused shape")
            .expect("fused");
        assert_eq!((d.len(), d[2].dims.clone()), (3, vec![5, 4]));
        assert_eq!(
            split_fused_experts("model.layers.0.mlp.experts.0.down_proj.weight", &[5, 4, 3]),
            Ok(None)
        );
        let flat = split_fused_experts("model.layers.0.mlp.experts.down_proj", &[5, 4]).expect_err("2-D");
        assert!(flat.contains("[5, 4]"), "{flat}");
        let odd = split_fused_experts("model.layers.0.mlp.experts.gate_up_proj", &[8, 63, 64]).expect_err("odd");
        assert!(odd.contains("even"), "{odd}");
    }
}

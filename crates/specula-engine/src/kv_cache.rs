//! Per-sequence KV cache with rollback.
//!
//! Keys and values of each layer are stored as f32 in `[position, kv_head, head_dim]` order, in
//! owned memory sized on demand up to the context window. [`KvCache::truncate`] drops the
//! positions past a length: speculative decoding rolls back rejected draft tokens with it.

use anyhow::{bail, Result};

/// Keys and values of one sequence, for every layer.
#[derive(Debug, Clone)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Committed positions (the same for every layer between forwards).
    len: usize,
    /// `num_kv_heads * head_dim`: floats per position per layer.
    stride: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache for `layers` layers of `kv_heads × head_dim`, holding at most `capacity`
    /// positions.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self {
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
            len: 0,
            stride: kv_heads * head_dim,
            capacity,
        }
    }

    /// Number of committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum positions (the model's context window).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keep only the first `len` positions (no-op if `len >= self.len()`).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            for l in self.keys.iter_mut().chain(self.values.iter_mut()) {
                l.truncate(len * self.stride);
            }
        }
    }

    /// Drop rows appended by a forward pass that failed before [`KvCache::advance`].
    pub fn discard_uncommitted(&mut self) {
        let n = self.len * self.stride;
        for l in self.keys.iter_mut().chain(self.values.iter_mut()) {
            l.truncate(n);
        }
    }

    /// Drop everything.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.keys.len()
    }

    /// Floats per position per layer (`kv_heads * head_dim`).
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Bytes of memory in use.
    pub fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|l| l.len() * 4).sum()
    }

    /// Append the K and V rows (`[n, kv_heads, head_dim]` each) of layer `layer` for positions
    /// `len .. len + n`. The new positions count once [`KvCache::advance`] is called after every
    /// layer has appended.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        if k.len() != v.len() || !k.len().is_multiple_of(self.stride) {
            bail!(
                "kv append: bad row sizes {} / {} for stride {}",
                k.len(),
                v.len(),
                self.stride
            );
        }
        let expected = self.len * self.stride;
        let (kl, vl) = (&mut self.keys[layer], &mut self.values[layer]);
        if kl.len() != expected {
            bail!(
                "kv append: layer {layer} holds {} floats, expected {expected}",
                kl.len()
            );
        }
        if self.len + k.len() / self.stride > self.capacity {
            bail!("kv cache full ({} positions)", self.capacity);
        }
        kl.extend_from_slice(k);
        vl.extend_from_slice(v);
        Ok(())
    }

    /// Commit `n` positions appended to every layer.
    pub fn advance(&mut self, n: usize) -> Result<()> {
        let want = (self.len + n) * self.stride;
        if let Some(l) = self.keys.iter().find(|l| l.len() != want) {
            bail!("kv advance: a layer holds {} floats, expected {want}", l.len());
        }
        self.len += n;
        Ok(())
    }

    /// Keys and values of `layer` for the first `positions` positions (committed or just
    /// appended).
    pub fn layer(&self, layer: usize, positions: usize) -> (&[f32], &[f32]) {
        let n = positions * self.stride;
        (&self.keys[layer][..n], &self.values[layer][..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_advance_truncate() {
        let mut kv = KvCache::new(2, 1, 2, 8);
        for l in 0..2 {
            kv.append(l, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        }
        kv.advance(2).unwrap();
        assert_eq!(kv.len(), 2);
        assert_eq!(kv.layer(1, 2).0, &[1.0, 2.0, 3.0, 4.0]);
        kv.truncate(1);
        assert_eq!(kv.len(), 1);
        assert_eq!(kv.layer(0, 1).1, &[5.0, 6.0]);
        // A layer that did not append makes advance fail.
        kv.append(0, &[9.0, 9.0], &[9.0, 9.0]).unwrap();
        assert!(kv.advance(1).is_err());
    }

    #[test]
    fn capacity_is_enforced() {
        let mut kv = KvCache::new(1, 1, 1, 2);
        assert!(kv.append(0, &[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).is_err());
    }
}

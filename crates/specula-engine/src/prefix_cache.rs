//! An exact prefix cache: the KV rows of token prefixes already computed, reused by later
//! requests that start with the same tokens.
//!
//! Keys are chains over fixed blocks of [`BLOCK_TOKENS`] tokens: block `i`'s key hashes block
//! `i - 1`'s key with block `i`'s tokens (the scheme of vLLM's automatic prefix caching), so a
//! block is found only after the same whole prefix. A hit is checked token by token (no trust in
//! the hash alone). Entries live under a memory budget with least-recently-used eviction.
//!
//! **Exactness.** The KV rows of a position depend only on the tokens up to it: the projections
//! and attention are row-invariant ([`crate::model::Model::batch_invariant`]), so rows computed in
//! a long prefill chunk, in a decode step or in a verify block are the same bits. Copying cached
//! rows into a new sequence therefore gives the KV a cold prefill would compute, and the output
//! is byte-identical to a cold run. The engine uses the cache only on batch-invariant models. One
//! cache serves one model (the engine's), so the key needs no model id; drafters keep their own
//! KV (a draft model re-prefills from the context).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use anyhow::Result;

use crate::kv_cache::KvCache;

/// Tokens per cached block.
pub const BLOCK_TOKENS: usize = 16;

struct Block {
    /// The previous block's key (0 for the first block).
    parent: u64,
    tokens: [u32; BLOCK_TOKENS],
    /// Per layer: K and V rows of the block's positions (`[BLOCK_TOKENS, kv_heads, head_dim]`).
    keys: Vec<Vec<half::f16>>,
    values: Vec<Vec<half::f16>>,
    last_used: u64,
}

impl Block {
    fn bytes(&self) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|l| l.len() * crate::kv_cache::KV_ELEM_BYTES)
            .sum::<usize>()
            + 64
    }
}

/// Counters of a [`PrefixCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Lookups that reused at least one block.
    pub hits: u64,
    /// Lookups that reused nothing.
    pub misses: u64,
    /// Prompt tokens served from the cache, over all lookups.
    pub hit_tokens: u64,
    /// Blocks evicted to stay under the budget.
    pub evicted_blocks: u64,
    /// Blocks held now.
    pub blocks: usize,
    /// Bytes held now.
    pub bytes: usize,
    /// The budget in bytes.
    pub budget_bytes: usize,
}

/// KV rows of seen prefixes, by chained block key.
pub struct PrefixCache {
    blocks: HashMap<u64, Block>,
    budget_bytes: usize,
    bytes: usize,
    clock: u64,
    stats: PrefixCacheStats,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache").field("stats", &self.stats()).finish()
    }
}

fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    // 0 marks "no parent"; keep it out of the key space.
    h.finish().max(1)
}

impl PrefixCache {
    /// An empty cache holding at most `budget_bytes` of KV rows.
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            blocks: HashMap::new(),
            budget_bytes,
            bytes: 0,
            clock: 0,
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            blocks: self.blocks.len(),
            bytes: self.bytes,
            budget_bytes: self.budget_bytes,
            ..self.stats
        }
    }

    /// Copy the KV rows of the longest cached prefix of `tokens` (whole blocks, at most
    /// `max_tokens` positions) into `kv`, which must be empty. Returns the number of positions
    /// filled (a multiple of [`BLOCK_TOKENS`], 0 on a miss).
    pub fn lookup(&mut self, tokens: &[u32], max_tokens: usize, kv: &mut KvCache) -> Result<usize> {
        debug_assert!(kv.is_empty());
        self.clock += 1;
        let mut parent = 0u64;
        let mut n = 0;
        for block in tokens[..max_tokens.min(tokens.len())].chunks_exact(BLOCK_TOKENS) {
            let key = chain(parent, block);
            let Some(b) = self.blocks.get_mut(&key) else {
                break;
            };
            if b.parent != parent || b.tokens != block {
                break;
            }
            b.last_used = self.clock;
            for (layer, (k, v)) in b.keys.iter().zip(&b.values).enumerate() {
                kv.append_f16(layer, k, v)?;
            }
            kv.advance(BLOCK_TOKENS)?;
            n += BLOCK_TOKENS;
            parent = key;
        }
        if n > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += n as u64;
        } else {
            self.stats.misses += 1;
        }
        Ok(n)
    }

    /// Remember the KV rows of `tokens[..positions]` from `kv` (whole blocks; `kv` must hold at
    /// least `positions` positions computed from exactly those tokens), then evict the least
    /// recently used blocks beyond the budget.
    pub fn insert(&mut self, tokens: &[u32], positions: usize, kv: &KvCache) {
        self.clock += 1;
        let positions = positions.min(tokens.len()).min(kv.len());
        let layers = kv.num_layers();
        let mut parent = 0u64;
        for (i, block) in tokens[..positions].chunks_exact(BLOCK_TOKENS).enumerate() {
            let key = chain(parent, block);
            match self.blocks.get_mut(&key) {
                Some(b) if b.parent == parent && b.tokens == block => b.last_used = self.clock,
                Some(_) => break, // a hash collision with another prefix: keep the old entry
                None => {
                    let mut keys = Vec::with_capacity(layers);
                    let mut values = Vec::with_capacity(layers);
                    for layer in 0..layers {
                        let (k, v) = kv
                            .rows(layer, positions)
                            .copy_range(i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS);
                        keys.push(k);
                        values.push(v);
                    }
                    let mut toks = [0u32; BLOCK_TOKENS];
                    toks.copy_from_slice(block);
                    let b = Block {
                        parent,
                        tokens: toks,
                        keys,
                        values,
                        last_used: self.clock,
                    };
                    self.bytes += b.bytes();
                    self.blocks.insert(key, b);
                }
            }
            parent = key;
        }
        self.evict();
    }

    fn evict(&mut self) {
        if self.bytes <= self.budget_bytes {
            return;
        }
        let mut order: Vec<(u64, u64)> = self.blocks.iter().map(|(&k, b)| (b.last_used, k)).collect();
        order.sort_unstable();
        for (_, key) in order {
            if self.bytes <= self.budget_bytes {
                break;
            }
            if let Some(b) = self.blocks.remove(&key) {
                self.bytes -= b.bytes();
                self.stats.evicted_blocks += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of `n` positions whose K/V values encode (layer, position).
    fn kv_of(n: usize) -> KvCache {
        let mut kv = KvCache::new(2, 1, 2, 1024);
        for layer in 0..2 {
            let k: Vec<f32> = (0..n * 2).map(|i| (layer * 1000 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            kv.append(layer, &k, &v).expect("append");
        }
        kv.advance(n).expect("advance");
        kv
    }

    #[test]
    fn a_cached_prefix_is_copied_back_exactly() {
        let tokens: Vec<u32> = (0..50).collect();
        let kv = kv_of(50);
        let mut c = PrefixCache::new(1 << 20);
        c.insert(&tokens, 50, &kv);
        assert_eq!(c.stats().blocks, 3, "three whole blocks of 16");
        // Same first 40 tokens, then different: two blocks match.
        let mut other: Vec<u32> = (0..40).collect();
        other.extend([7, 7, 7, 7, 7, 7, 7, 7, 7, 7]);
        let mut got = KvCache::new(2, 1, 2, 1024);
        assert_eq!(c.lookup(&other, other.len() - 1, &mut got).expect("lookup"), 32);
        for layer in 0..2 {
            assert_eq!(got.layer_vecs(layer, 32), kv.layer_vecs(layer, 32));
        }
        // max_tokens bounds the reuse.
        let mut got = KvCache::new(2, 1, 2, 1024);
        assert_eq!(c.lookup(&tokens, 20, &mut got).expect("lookup"), 16);
        // A different first block: nothing.
        let mut got = KvCache::new(2, 1, 2, 1024);
        let miss: Vec<u32> = (1..51).collect();
        assert_eq!(c.lookup(&miss, 49, &mut got).expect("lookup"), 0);
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.hit_tokens), (2, 1, 48));
    }

    #[test]
    fn the_budget_evicts_least_recently_used_blocks() {
        let kv = kv_of(64);
        let a: Vec<u32> = (0..64).collect();
        let b: Vec<u32> = (100..164).collect();
        let mut probe = PrefixCache::new(usize::MAX);
        probe.insert(&a, 64, &kv);
        let four_blocks = probe.stats().bytes;
        let mut c = PrefixCache::new(four_blocks + four_blocks / 2);
        c.insert(&a, 64, &kv);
        c.insert(&b, 64, &kv);
        let s = c.stats();
        assert!(s.bytes <= s.budget_bytes);
        assert_eq!(s.evicted_blocks, 2);
        // `a`'s first blocks were the least recently used: gone, so nothing of `a` is reachable.
        let mut got = KvCache::new(2, 1, 2, 1024);
        assert_eq!(c.lookup(&a, 63, &mut got).expect("lookup"), 0);
        let mut got = KvCache::new(2, 1, 2, 1024);
        assert_eq!(c.lookup(&b, 63, &mut got).expect("lookup"), 48);
    }
}

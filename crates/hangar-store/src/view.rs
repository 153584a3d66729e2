//! Views: a tensor-parallel rank's shard of an artifact.
//!
//! A [`ViewSpec`] says `rank r of n` and, per tensor-name glob, the dimension
//! to split. A tensor matching no rule is replicated whole. Along the split
//! dimension of size `D` every rank gets `c = ceil(D / n)` rows; rank `r`
//! holds rows `r*c .. min((r+1)*c, D)` and the rest of its `c` rows are zero
//! padding, so all ranks see the same shapes.
//!
//! [`ViewPlan`] turns a spec and the parent's index into the view's own
//! canonical index and a list of byte copies from parent to view, so only the
//! parent chunks holding needed bytes are read ([`ViewPlan::execute`]). A
//! view's id is derived from the parent id and the canonical spec
//! ([`crate::id::ArtifactId::view_of`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::chunks::{chunk_range, CHUNK_SIZE};
use crate::error::StoreError;
use crate::index::{CanonicalIndex, TensorSpec};

/// Split tensors matching `pattern` along `dim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewRule {
    /// Glob over tensor names (`*`, `?`, `[..]`), e.g. `layers.*.mlp.weight`.
    pub pattern: String,
    /// Dimension to split.
    pub dim: u32,
}

/// `rank` of `world`, with rules tried in order (first match wins).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewSpec {
    /// This shard's rank, `< world`.
    pub rank: u32,
    /// Number of shards.
    pub world: u32,
    /// Split rules.
    pub rules: Vec<ViewRule>,
}

impl ViewSpec {
    /// The canonical text hashed into the view id.
    pub fn canonical(&self) -> String {
        self.to_string()
    }
}

/// Text form: `RANK/WORLD:GLOB=DIM,GLOB=DIM…`, e.g. `1/4:*.weight=0,*.bias=0`.
impl fmt::Display for ViewSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:", self.rank, self.world)?;
        for (i, r) in self.rules.iter().enumerate() {
            write!(f, "{}{}={}", if i > 0 { "," } else { "" }, r.pattern, r.dim)?;
        }
        Ok(())
    }
}

impl FromStr for ViewSpec {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| StoreError::View(format!("`{s}`: {why}; expected RANK/WORLD:GLOB=DIM,…"));
        let (rw, rules) = s.split_once(':').ok_or_else(|| bad("missing `:`"))?;
        let (rank, world) = rw.split_once('/').ok_or_else(|| bad("missing `/`"))?;
        let rank: u32 = rank.parse().map_err(|_| bad("rank is not a number"))?;
        let world: u32 = world.parse().map_err(|_| bad("world is not a number"))?;
        let rules = rules
            .split(',')
            .filter(|r| !r.is_empty())
            .map(|r| {
                let (p, d) = r.rsplit_once('=').ok_or_else(|| bad("rule without `=DIM`"))?;
                let dim = d.parse().map_err(|_| bad("dim is not a number"))?;
                Ok(ViewRule { pattern: p.to_owned(), dim })
            })
            .collect::<Result<_, StoreError>>()?;
        let spec = ViewSpec { rank, world, rules };
        spec.validate()?;
        Ok(spec)
    }
}

impl ViewSpec {
    /// Checks rank, world and globs.
    pub fn validate(&self) -> Result<(), StoreError> {
        if self.world == 0 || self.rank >= self.world {
            return Err(StoreError::View(format!(
                "rank {} of world {} is out of range",
                self.rank, self.world
            )));
        }
        for r in &self.rules {
            glob::Pattern::new(&r.pattern)
                .map_err(|e| StoreError::View(format!("pattern `{}`: {e}", r.pattern)))?;
        }
        Ok(())
    }
}

/// Copy `len` bytes from parent offset `src` to view offset `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// Canonical offset in the parent.
    pub src: u64,
    /// Canonical offset in the view.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// A view's layout and the bytes it needs from its parent.
#[derive(Debug, Clone)]
pub struct ViewPlan {
    /// The view's canonical index.
    pub index: CanonicalIndex,
    /// Copies in increasing `src` order; view bytes not written are zero.
    pub ops: Vec<CopyOp>,
}

impl ViewPlan {
    /// Plans `spec` over `parent`.
    pub fn new(parent: &CanonicalIndex, spec: &ViewSpec) -> Result<Self, StoreError> {
        spec.validate()?;
        let patterns: Vec<(glob::Pattern, u32)> =
            spec.rules.iter().map(|r| (glob::Pattern::new(&r.pattern).expect("validated"), r.dim)).collect();
        let (n, r) = (spec.world as u64, spec.rank as u64);
        let mut specs = Vec::with_capacity(parent.tensors.len());
        // (parent tensor, split: Some((dim, c, valid, outer, row bytes)))
        let mut splits = Vec::with_capacity(parent.tensors.len());
        for t in &parent.tensors {
            let Some(dim) = patterns.iter().find(|(p, _)| p.matches(&t.name)).map(|(_, d)| *d as usize)
            else {
                specs.push(TensorSpec { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() });
                splits.push(None);
                continue;
            };
            if dim >= t.shape.len() {
                return Err(StoreError::View(format!(
                    "tensor `{}` has {} dimensions; cannot split dim {dim}",
                    t.name,
                    t.shape.len()
                )));
            }
            let d = t.shape[dim];
            let c = d.div_ceil(n);
            let valid = d.min((r + 1) * c).saturating_sub(r * c);
            let outer: u64 = t.shape[..dim].iter().product();
            let inner_elems: u64 = t.shape[dim + 1..].iter().product();
            let bits = inner_elems * t.dtype.bitsize() as u64;
            if bits % 8 != 0 {
                return Err(StoreError::View(format!(
                    "tensor `{}`: rows of {} are not whole bytes",
                    t.name, t.dtype
                )));
            }
            let mut shape = t.shape.clone();
            shape[dim] = c;
            specs.push(TensorSpec { name: t.name.clone(), dtype: t.dtype, shape });
            splits.push(Some((d, c, valid, outer, bits / 8)));
        }
        let index = CanonicalIndex::build(specs)?;
        let mut ops = Vec::new();
        for ((pt, vt), split) in parent.tensors.iter().zip(&index.tensors).zip(splits) {
            match split {
                None => ops.push(CopyOp { src: pt.offset, dst: vt.offset, len: pt.len }),
                Some((_, _, 0, _, _)) => {}
                Some((d, c, valid, outer, row)) => {
                    if c == d {
                        // World of one along this dim (or c covers all rows): one run.
                        ops.push(CopyOp { src: pt.offset, dst: vt.offset, len: pt.len });
                        continue;
                    }
                    for o in 0..outer {
                        ops.push(CopyOp {
                            src: pt.offset + (o * d + r * c) * row,
                            dst: vt.offset + o * c * row,
                            len: valid * row,
                        });
                    }
                }
            }
        }
        ops.retain(|op| op.len > 0);
        Ok(ViewPlan { index, ops })
    }

    /// Parent chunks this view reads.
    pub fn needed_chunks(&self) -> Vec<usize> {
        let mut out: Vec<usize> = Vec::new();
        for op in &self.ops {
            let first = (op.src / CHUNK_SIZE) as usize;
            let last = ((op.src + op.len - 1) / CHUNK_SIZE) as usize;
            for c in first..=last {
                if out.last() != Some(&c) {
                    out.push(c);
                }
            }
        }
        out
    }

    /// Fills `dst` (the view's data, zeroed) from the parent, reading each
    /// needed parent chunk once through `read_chunk(i, buf)`, which must
    /// fill `buf` with verified bytes of chunk `i`.
    pub fn execute(
        &self,
        parent_len: u64,
        dst: &mut [u8],
        mut read_chunk: impl FnMut(usize, &mut [u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let mut buf = vec![0u8; CHUNK_SIZE as usize];
        for i in self.needed_chunks() {
            let (cs, ce) = chunk_range(i, parent_len);
            let chunk = &mut buf[..(ce - cs) as usize];
            read_chunk(i, chunk)?;
            self.apply_chunk(i, parent_len, chunk, dst);
        }
        Ok(())
    }

    /// Copies the parts of parent chunk `i` (its verified bytes in
    /// `chunk`) that the view holds into `dst`, the view's data. Chunks may
    /// come in any order; each is applied once.
    pub fn apply_chunk(&self, i: usize, parent_len: u64, chunk: &[u8], dst: &mut [u8]) {
        let (cs, ce) = chunk_range(i, parent_len);
        // Ops are in increasing, non-overlapping `src` order.
        let first = self.ops.partition_point(|op| op.src + op.len <= cs);
        for op in &self.ops[first..] {
            if op.src >= ce {
                break;
            }
            let a = op.src.max(cs);
            let b = (op.src + op.len).min(ce);
            let d = (op.dst + (a - op.src)) as usize;
            dst[d..d + (b - a) as usize].copy_from_slice(&chunk[(a - cs) as usize..(b - cs) as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use safetensors::Dtype;

    use super::*;

    #[test]
    fn spec_text_round_trips_and_validates() {
        let s: ViewSpec = "1/4:*.weight=0,*.bias=0".parse().unwrap();
        assert_eq!(s.to_string(), "1/4:*.weight=0,*.bias=0");
        for bad in ["4/4:a=0", "0/0:a=0", "x/2:a=0", "0/2", "0/2:a", "0/2:[=0"] {
            assert!(bad.parse::<ViewSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn shards_have_equal_shapes_and_zero_padding() {
        let parent =
            CanonicalIndex::build(vec![TensorSpec { name: "w".into(), dtype: Dtype::U8, shape: vec![5, 2] }])
                .unwrap();
        let data: Vec<u8> = (0..10).collect();
        for rank in 0..2 {
            let plan = ViewPlan::new(&parent, &format!("{rank}/2:w=0").parse().unwrap()).unwrap();
            assert_eq!(plan.index.tensors[0].shape, vec![3, 2]);
            let mut out = vec![0u8; plan.index.data_len as usize];
            plan.execute(10, &mut out, |i, buf| {
                assert_eq!(i, 0);
                buf.copy_from_slice(&data);
                Ok(())
            })
            .unwrap();
            let want: &[u8] = if rank == 0 { &[0, 1, 2, 3, 4, 5] } else { &[6, 7, 8, 9, 0, 0] };
            assert_eq!(out, want);
        }
        let err = ViewPlan::new(&parent, &"0/2:w=2".parse().unwrap()).unwrap_err();
        assert!(err.to_string().contains("cannot split dim 2"), "{err}");
    }
}

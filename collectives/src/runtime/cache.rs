//! Horovod's response cache: every rank keeps the same table of tensors negotiated before,
//! each under a *cache bit*, so that a steady workload negotiates with bits instead of names.
//!
//! A rank whose ready tensor is in its table with exactly the same request (name, op, dtype,
//! shape) sends the tensor's bit; anything else (a new name, or a cached name with another
//! shape, dtype or op: a possible mismatch) goes the full way, by request. Rank 0 turns bits
//! back into requests, so its decisions are the same as without a cache, and names in its
//! response the tensors that every rank caches by their bits.
//!
//! The tables stay the same on every rank because they change only through responses, which
//! every rank receives alike, and always the same way ([`ResponseCache::apply`]): in response
//! order, a scheduled tensor is put (or refreshed) as the most recently used, a failed one is
//! removed, and a full table gives the least recently used tensor's bit to the new one. So
//! the name of every bit is the same everywhere; what is stored with it differs: each rank
//! keeps its own request, rank 0's coordinator what every rank asked. This module must never
//! change a table from what one rank alone knows.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::messages::{BitRun, Item, Ready, Response, TensorRef, TensorRequest, WireResponse};

/// Horovod's default capacity (defined with the other defaults read from the environment).
pub use crate::knobs::DEFAULT_CACHE_CAPACITY;

/// A table of up to `capacity` negotiated tensors, each under a bit in `0..capacity`, with
/// what this side stores about it (`P`), evicting the least recently used when full.
#[derive(Debug)]
pub struct ResponseCache<P> {
    capacity: usize,
    /// Indexed by bit.
    slots: Vec<Option<Slot<P>>>,
    bits: HashMap<String, u32, foldhash::fast::RandomState>,
    /// Bits by the time of their last use: the first is the least recently used.
    recency: BTreeMap<u64, u32>,
    clock: u64,
    /// Bits below `slots.len()` freed by erasures; the lowest is given out first.
    free: BTreeSet<u32>,
}

#[derive(Debug)]
struct Slot<P> {
    name: String,
    params: P,
    used: u64,
}

impl<P> ResponseCache<P> {
    /// An empty table of `capacity` bits; 0 disables caching (nothing is ever put).
    pub fn new(capacity: usize) -> Self {
        ResponseCache {
            // Bits are u32 on the wire.
            capacity: capacity.min(u32::MAX as usize),
            slots: Vec::new(),
            bits: HashMap::default(),
            recency: BTreeMap::new(),
            clock: 0,
            free: BTreeSet::new(),
        }
    }

    /// Most tensors the table holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tensors it holds now.
    pub fn len(&self) -> usize {
        self.bits.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.bits.is_empty()
    }

    /// The bit of `name` and what is stored with it.
    pub fn bit(&self, name: &str) -> Option<(u32, &P)> {
        let bit = *self.bits.get(name)?;
        let slot = self.slots.get(bit as usize)?.as_ref()?;
        Some((bit, &slot.params))
    }

    /// The name under `bit` and what is stored with it.
    pub fn get(&self, bit: u64) -> Option<(&str, &P)> {
        let slot = self.slots.get(usize::try_from(bit).ok()?)?.as_ref()?;
        Some((&slot.name, &slot.params))
    }

    /// Puts `name` with `params` as the most recently used tensor: a cached name keeps its
    /// bit (its params are replaced); a new one takes the lowest free bit, or the least
    /// recently used tensor's bit when the table is full.
    pub fn put(&mut self, name: &str, params: P) {
        if self.capacity == 0 {
            return;
        }
        self.clock += 1;
        let used = self.clock;
        if let Some(&bit) = self.bits.get(name)
            && let Some(Some(slot)) = self.slots.get_mut(bit as usize)
        {
            self.recency.remove(&slot.used);
            slot.params = params;
            slot.used = used;
            self.recency.insert(used, bit);
            return;
        }
        let bit = if let Some(bit) = self.free.pop_first() {
            bit
        } else if self.slots.len() < self.capacity {
            self.slots.push(None);
            (self.slots.len() - 1) as u32
        } else {
            let Some((_, bit)) = self.recency.pop_first() else {
                return;
            };
            if let Some(old) = self.slots.get_mut(bit as usize).and_then(Option::take) {
                self.bits.remove(&old.name);
            }
            bit
        };
        self.slots[bit as usize] = Some(Slot {
            name: name.to_string(),
            params,
            used,
        });
        self.bits.insert(name.to_string(), bit);
        self.recency.insert(used, bit);
    }

    /// Removes `name`; its bit is free for the next new tensor.
    pub fn erase(&mut self, name: &str) {
        let Some(bit) = self.bits.remove(name) else {
            return;
        };
        if let Some(old) = self.slots.get_mut(bit as usize).and_then(Option::take) {
            self.recency.remove(&old.used);
        }
        self.free.insert(bit);
    }

    /// Changes the capacity; tensors whose bits are past the new capacity are removed.
    pub fn set_capacity(&mut self, capacity: usize) {
        let capacity = capacity.min(u32::MAX as usize);
        if capacity < self.slots.len() {
            for slot in self.slots.drain(capacity..).flatten() {
                self.bits.remove(&slot.name);
                self.recency.remove(&slot.used);
            }
            self.free.retain(|&b| (b as usize) < capacity);
        }
        self.capacity = capacity;
    }

    /// The one way a response changes a table, the same on every rank and in rank 0's
    /// coordinator: in response order, every scheduled tensor is put with `params(name)`
    /// (removed if there is none: such a tensor is never sent by bit), every failed one
    /// removed, so that its next use goes the full way.
    pub fn apply(&mut self, items: &[Item], mut params: impl FnMut(&str) -> Option<P>) {
        let mut record = |cache: &mut Self, name: &str| match params(name) {
            Some(p) => cache.put(name, p),
            None => cache.erase(name),
        };
        for item in items {
            match item {
                Item::Allreduce { names, .. } => {
                    for name in names {
                        record(self, name);
                    }
                }
                Item::Allgather { name, .. } | Item::Broadcast { name, .. } => record(self, name),
                Item::Error { name, .. } => self.erase(name),
            }
        }
    }

    /// [`Self::apply`] for items whose every tensor this table holds with the params it
    /// would be given again (a settled cycle's): each becomes the most recently used, in
    /// order, and nothing is cloned.
    pub fn refresh(&mut self, items: &[Item]) {
        for item in items {
            let names: &[String] = match item {
                Item::Allreduce { names, .. } => names,
                Item::Allgather { name, .. } | Item::Broadcast { name, .. } => {
                    std::slice::from_ref(name)
                }
                Item::Error { name, .. } => {
                    self.erase(name);
                    continue;
                }
            };
            for name in names {
                self.touch(name);
            }
        }
    }

    /// Makes the cached tensor `name` the most recently used, as [`Self::refresh`] does
    /// for each tensor of a settled cycle; a name not cached is left alone.
    pub fn touch(&mut self, name: &str) {
        let Some(&bit) = self.bits.get(name) else {
            return;
        };
        if let Some(Some(slot)) = self.slots.get_mut(bit as usize) {
            if slot.used == self.clock {
                // The most recently used already (a lone tensor in a loop): the order,
                // which is all the clock is for, stays as it is.
                return;
            }
            self.clock += 1;
            self.recency.remove(&slot.used);
            slot.used = self.clock;
            self.recency.insert(self.clock, bit);
        }
    }

    /// `items` with every tensor this table holds named by its bit (consecutive bits as one
    /// run). Must be called before [`Self::apply`] of the same items: ranks decode with
    /// the table as it was.
    pub fn encode(&self, items: Vec<Item>) -> Vec<Item<TensorRef>> {
        let by_ref = |name: String| match self.bits.get(&name) {
            Some(&bit) => TensorRef::Cached(BitRun(bit, 1)),
            None => TensorRef::Name(name),
        };
        items
            .into_iter()
            .map(|item| match item {
                Item::Allreduce { names, dtype, op } => {
                    let mut refs: Vec<TensorRef> = Vec::new();
                    for name in names {
                        match (refs.last_mut(), self.bits.get(&name)) {
                            (Some(TensorRef::Cached(run)), Some(&bit)) if run.extends_to(bit) => {
                                run.1 += 1;
                            }
                            _ => refs.push(by_ref(name)),
                        }
                    }
                    Item::Allreduce {
                        names: refs,
                        dtype,
                        op,
                    }
                }
                Item::Allgather { name, first_dims } => Item::Allgather {
                    name: by_ref(name),
                    first_dims,
                },
                Item::Broadcast { name, root } => Item::Broadcast {
                    name: by_ref(name),
                    root,
                },
                Item::Error { name, message } => Item::Error { name, message },
            })
            .collect()
    }

    /// The names of `items` from this table (see [`Self::encode`]).
    pub fn decode(&self, items: Vec<Item<TensorRef>>) -> Result<Vec<Item>, String> {
        let one = |r: TensorRef| -> Result<String, String> {
            let mut names = self.names(r)?;
            match (names.pop(), names.is_empty()) {
                (Some(name), true) => Ok(name),
                _ => Err("a response item for one tensor names several".into()),
            }
        };
        items
            .into_iter()
            .map(|item| {
                Ok(match item {
                    Item::Allreduce { names, dtype, op } => {
                        let mut plain = Vec::with_capacity(names.len());
                        for r in names {
                            plain.extend(self.names(r)?);
                        }
                        Item::Allreduce {
                            names: plain,
                            dtype,
                            op,
                        }
                    }
                    Item::Allgather { name, first_dims } => Item::Allgather {
                        name: one(name)?,
                        first_dims,
                    },
                    Item::Broadcast { name, root } => Item::Broadcast {
                        name: one(name)?,
                        root,
                    },
                    Item::Error { name, message } => Item::Error { name, message },
                })
            })
            .collect()
    }

    fn names(&self, r: TensorRef) -> Result<Vec<String>, String> {
        match r {
            TensorRef::Name(name) => Ok(vec![name]),
            TensorRef::Cached(run) => {
                run.bits()
                    .map(|bit| {
                        self.get(bit).map(|(name, _)| name.to_string()).ok_or_else(|| {
                        format!(
                            "rank 0 named cache bit {bit}, which this rank's response cache \
                             does not hold (the caches diverged: a bug in collectives)"
                        )
                    })
                    })
                    .collect()
            }
        }
    }
}

/// One rank's side of the cache: which ready tensors it may send by bit, and rank 0's
/// responses turned back into names.
#[derive(Debug)]
pub struct RankCache {
    table: ResponseCache<TensorRequest>,
}

impl Default for RankCache {
    fn default() -> Self {
        Self::new()
    }
}

impl RankCache {
    /// An empty cache, off until rank 0's first response gives its capacity (rank 0 decides
    /// it, so that every rank has the same one).
    pub fn new() -> Self {
        RankCache {
            table: ResponseCache::new(0),
        }
    }

    /// The table (for tests and statistics).
    pub fn table(&self) -> &ResponseCache<TensorRequest> {
        &self.table
    }

    /// What this rank reports for tensors that became ready, in their order: the bit of each
    /// one cached with exactly this request (consecutive bits as one run), the whole request
    /// of any other.
    pub fn encode<'a>(&self, ready: impl IntoIterator<Item = &'a TensorRequest>) -> Vec<Ready> {
        let mut out: Vec<Ready> = Vec::new();
        for request in ready {
            match self.table.bit(&request.name) {
                Some((bit, cached)) if cached == request => match out.last_mut() {
                    Some(Ready::Cached(run)) if run.extends_to(bit) => run.1 += 1,
                    _ => out.push(Ready::Cached(BitRun(bit, 1))),
                },
                _ => out.push(Ready::Full(request.clone())),
            }
        }
        out
    }

    /// Changes the table as a settled cycle's `items` do on every rank (no message carried
    /// them): every tensor in them is cached here with exactly this rank's request.
    pub fn refresh(&mut self, items: &[Item]) {
        self.table.refresh(items);
    }

    /// [`Self::refresh`] for a settled cycle of one allreduce of `name`.
    pub fn touch(&mut self, name: &str) {
        self.table.touch(name);
    }

    /// Rank 0's `response` with names, after which this rank's table is changed the way
    /// every other rank's is. `local(name)` is this rank's own request of a tensor it has
    /// pending. Fails if the response names a bit this table does not hold.
    pub fn decode(
        &mut self,
        response: WireResponse,
        local: impl Fn(&str) -> Option<TensorRequest>,
    ) -> Result<Response, String> {
        if let Some(capacity) = response.cache_capacity {
            self.table.set_capacity(capacity);
        }
        let items = self.table.decode(response.items)?;
        let joined = &response.join_counts;
        // Tensors run while ranks have joined leave every cache (rank 0 keeps none).
        self.table.apply(&items, |name| {
            if joined.iter().any(|(n, _)| n == name) {
                None
            } else {
                local(name)
            }
        });
        Ok(Response {
            cycle: response.cycle,
            knobs: response.knobs,
            items,
            shutdown: response.shutdown,
            abort: response.abort,
            cache_capacity: response.cache_capacity,
            join_counts: response.join_counts,
            join_done: response.join_done,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::messages::OpKind;
    use crate::tensor::{DType, ReduceOp};

    fn names<P>(c: &ResponseCache<P>) -> Vec<Option<String>> {
        (0..c.slots.len() as u64)
            .map(|b| c.get(b).map(|(n, _)| n.to_string()))
            .collect()
    }

    #[test]
    fn a_full_table_gives_the_least_recently_used_bit_to_a_new_tensor() {
        let mut c = ResponseCache::new(3);
        for name in ["a", "b", "c"] {
            c.put(name, ());
        }
        c.put("a", ()); // b is now the least recently used
        c.put("d", ());
        assert_eq!(
            names(&c),
            [Some("a"), Some("d"), Some("c")].map(|n| n.map(String::from))
        );
        assert_eq!(c.bit("b"), None);
        assert_eq!(c.len(), 3);
        c.put("e", ()); // then c
        assert_eq!(c.bit("e").map(|(b, _)| b), Some(2));
    }

    #[test]
    fn erased_bits_are_reused_lowest_first_and_capacity_zero_holds_nothing() {
        let mut c = ResponseCache::new(8);
        for name in ["a", "b", "c", "d"] {
            c.put(name, ());
        }
        c.erase("c");
        c.erase("b");
        c.erase("zzz");
        c.put("x", ());
        c.put("y", ());
        c.put("z", ());
        assert_eq!(c.bit("x").map(|(b, _)| b), Some(1));
        assert_eq!(c.bit("y").map(|(b, _)| b), Some(2));
        assert_eq!(c.bit("z").map(|(b, _)| b), Some(4));
        c.set_capacity(2);
        assert_eq!(
            names(&c),
            [Some("a"), Some("x")].map(|n| n.map(String::from))
        );
        c.put("w", ()); // full: evicts a, the least recently used
        assert_eq!(c.bit("w").map(|(b, _)| b), Some(0));
        let mut off = ResponseCache::new(0);
        off.put("a", ());
        assert!(off.is_empty());
    }

    #[test]
    fn responses_encode_cached_names_as_runs_and_decode_back() {
        let mut c = ResponseCache::new(16);
        for name in ["g2", "g1", "g0", "ag"] {
            c.put(name, ());
        }
        let items = vec![
            Item::Allreduce {
                names: ["g2", "g1", "new", "g0"].map(String::from).to_vec(),
                dtype: DType::F32,
                op: ReduceOp::Sum,
            },
            Item::Allgather {
                name: "ag".into(),
                first_dims: vec![1, 2],
            },
            Item::Error {
                name: "g0".into(),
                message: "m".into(),
            },
        ];
        let wire = c.encode(items.clone());
        match &wire[0] {
            Item::Allreduce { names, .. } => assert_eq!(
                names,
                &vec![
                    TensorRef::Cached(BitRun(0, 2)),
                    TensorRef::Name("new".into()),
                    TensorRef::Cached(BitRun(2, 1))
                ]
            ),
            other => panic!("{other:?}"),
        }
        let json = serde_json::to_string(&wire).unwrap();
        let back: Vec<Item<TensorRef>> = serde_json::from_str(&json).unwrap();
        assert_eq!(c.decode(back).unwrap(), items);
        let unknown = vec![Item::Broadcast {
            name: TensorRef::Cached(BitRun(9, u32::MAX)),
            root: 0,
        }];
        assert!(c.decode(unknown).unwrap_err().contains("cache bit 9"));
    }

    #[test]
    fn a_rank_sends_bits_only_for_identical_requests() {
        let req = |name: &str, shape: &[usize]| TensorRequest {
            name: name.into(),
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            shape: shape.to_vec(),
            device: false,
        };
        let mut rank = RankCache::new();
        rank.table.set_capacity(4);
        for r in [req("a", &[4]), req("b", &[4]), req("c", &[4])] {
            let name = r.name.clone();
            rank.table.put(&name, r);
        }
        let ready = [
            req("a", &[4]),
            req("b", &[4]),
            req("c", &[5]),
            req("d", &[4]),
        ];
        assert_eq!(
            rank.encode(&ready),
            vec![
                Ready::Cached(BitRun(0, 2)),
                Ready::Full(req("c", &[5])),
                Ready::Full(req("d", &[4]))
            ]
        );
        let json = serde_json::to_string(&rank.encode(&ready)).unwrap();
        let back: Vec<Ready> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, rank.encode(&ready));
    }
}

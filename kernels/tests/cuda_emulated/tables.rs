//! Launch tables of host addresses, built by the real `LaunchTable`: Rust and CUDA must agree on the
//! layout.

use amp_kernels::cuda::{LaunchTable, TensorKind};
use amp_kernels::Dtype;

use crate::common::bf16_state::Bf16State;
use crate::common::{Owned, State};
use crate::data::dtype;
use crate::launch::Shared;

/// Elements per block in the tests' tables: small, so tensors span several blocks.
const CHUNK: usize = 1000;

/// A table, and the kernels' arguments taken from it.
pub struct Table(LaunchTable);

impl Table {
    /// `lists[l][t]`: the host address of tensor `t` in list `l` (0: absent).
    fn new(lists: &[Vec<u64>], lens: &[usize], kinds: &[TensorKind]) -> Table {
        let lists: Vec<&[u64]> = lists.iter().map(Vec::as_slice).collect();
        Table(LaunchTable::new(&lists, lens, kinds, CHUNK).expect("table"))
    }

    pub fn words(&self) -> Shared<u64> {
        Shared::new(self.0.words().as_ptr())
    }

    pub fn first_block(&self) -> Shared<u64> {
        Shared::new(self.0.first_block().as_ptr())
    }

    /// The kernels' `n`.
    pub fn n(&self) -> i32 {
        i32::try_from(self.0.tensors()).expect("tensor count")
    }

    /// The kernels' `lists`.
    pub fn lists(&self) -> i32 {
        i32::try_from(self.0.lists()).expect("list count")
    }

    pub fn tensors(&self) -> usize {
        self.0.tensors()
    }

    pub fn blocks(&self) -> usize {
        self.0.blocks()
    }
}

fn address(o: &mut Owned) -> u64 {
    match o {
        Owned::F32(v) => v.as_mut_ptr() as u64,
        Owned::F16(v) => v.as_mut_ptr() as u64,
        Owned::Bf16(v) => v.as_mut_ptr() as u64,
    }
}

/// A table whose list 0 is `grads`, followed by `lists - 1` absent lists.
pub fn grads_table(grads: &mut [Owned], lists: usize) -> Table {
    let kinds: Vec<TensorKind> = grads.iter().map(|g| TensorKind::grad(dtype(g))).collect();
    let lens: Vec<usize> = grads.iter().map(Owned::len).collect();
    let mut words = vec![grads.iter_mut().map(address).collect::<Vec<u64>>()];
    words.resize(lists, vec![0; grads.len()]);
    Table::new(&words, &lens, &kinds)
}

/// What a list of an optimizer's table holds.
#[derive(Clone, Copy)]
pub enum Slot {
    Grad,
    Master,
    A,
    B,
    C,
    Working,
    /// The tensor's random stream (a number, not an address): [`stream`] of its index.
    Stream,
    Absent,
}

/// The random stream of tensor `t` in the tests' tables (the reference's tensors must use the same).
pub fn stream(t: usize) -> u64 {
    0x5EED_0000 + t as u64
}

/// A tensor of an optimizer's table: its element types, length and the word of each slot.
pub trait Row {
    fn kind(&self) -> TensorKind;
    fn len(&self) -> usize;
    /// The word of `slot` for this tensor, the `index`-th of its table.
    fn word(&mut self, slot: Slot, index: usize) -> u64;
}

impl Row for State {
    fn kind(&self) -> TensorKind {
        TensorKind { grad: dtype(&self.grad), working: self.working.as_ref().map(dtype), state: Dtype::F32 }
    }
    fn len(&self) -> usize {
        self.master.len()
    }
    fn word(&mut self, slot: Slot, index: usize) -> u64 {
        match slot {
            Slot::Grad => address(&mut self.grad),
            Slot::Master => self.master.as_mut_ptr() as u64,
            Slot::A => self.a.as_mut_ptr() as u64,
            Slot::B => self.b.as_mut_ptr() as u64,
            Slot::C => self.c.as_mut().map_or(0, |c| c.as_mut_ptr() as u64),
            Slot::Working => self.working.as_mut().map_or(0, address),
            Slot::Stream => stream(index),
            Slot::Absent => 0,
        }
    }
}

/// bf16 state: `A` and `B` are its bf16 buffers.
impl Row for Bf16State {
    fn kind(&self) -> TensorKind {
        TensorKind { state: Dtype::Bf16, ..self.state.kind() }
    }
    fn len(&self) -> usize {
        self.state.master.len()
    }
    fn word(&mut self, slot: Slot, index: usize) -> u64 {
        match slot {
            Slot::A => self.a.as_mut_ptr() as u64,
            Slot::B => self.b.as_mut_ptr() as u64,
            Slot::C => 0,
            _ => self.state.word(slot, index),
        }
    }
}

/// A table with one list per slot.
pub fn states_table<R: Row>(rows: &mut [R], slots: &[Slot]) -> Table {
    let kinds: Vec<TensorKind> = rows.iter().map(Row::kind).collect();
    let lens: Vec<usize> = rows.iter().map(Row::len).collect();
    let words: Vec<Vec<u64>> = slots
        .iter()
        .map(|&slot| rows.iter_mut().enumerate().map(|(t, r)| r.word(slot, t)).collect())
        .collect();
    Table::new(&words, &lens, &kinds)
}

//! Launch tables of host addresses, built by the real `LaunchTable`: Rust and CUDA must agree on the
//! layout.

use amp_kernels::cuda::{LaunchTable, TensorKind};

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
    Absent,
}

fn slot_address(s: &mut State, slot: Slot) -> u64 {
    match slot {
        Slot::Grad => address(&mut s.grad),
        Slot::Master => s.master.as_mut_ptr() as u64,
        Slot::A => s.a.as_mut_ptr() as u64,
        Slot::B => s.b.as_mut_ptr() as u64,
        Slot::C => s.c.as_mut().map_or(0, |c| c.as_mut_ptr() as u64),
        Slot::Working => s.working.as_mut().map_or(0, address),
        Slot::Absent => 0,
    }
}

/// A table with one list per slot.
pub fn states_table(states: &mut [State], slots: &[Slot]) -> Table {
    let kinds: Vec<TensorKind> = states
        .iter()
        .map(|s| TensorKind { grad: dtype(&s.grad), working: s.working.as_ref().map(dtype) })
        .collect();
    let lens: Vec<usize> = states.iter().map(|s| s.master.len()).collect();
    let words: Vec<Vec<u64>> =
        slots.iter().map(|&slot| states.iter_mut().map(|s| slot_address(s, slot)).collect()).collect();
    Table::new(&words, &lens, &kinds)
}

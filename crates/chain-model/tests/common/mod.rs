//! What the chain models share (`model.rs`, `pipelined.rs`): rows of two keys, the clients'
//! operations, and the clients' side of a run — each client runs its script one operation at a
//! time, and every invocation and answer goes into its key's linearizability tester (each key a
//! register; linearizability is local, so checking each key alone checks the whole).
#![allow(dead_code)] // each model uses a different subset

use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

pub const KEYS: usize = 2;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Row {
    /// 0 is "never written" (the register's initial value).
    pub value: u8,
    pub version: u8,
    pub locked: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    Write(usize, u8),
    Read(usize),
}

impl Op {
    pub fn key(self) -> usize {
        match self {
            Op::Write(key, _) | Op::Read(key) => key,
        }
    }
}

/// The clients of one run.
#[derive(Clone, Debug, PartialEq, Hash)]
pub struct Clients {
    /// Each client's next operation in its script.
    next_op: Vec<usize>,
    /// Clients with an operation in flight.
    busy: Vec<bool>,
    testers: Vec<LinearizabilityTester<usize, Register<u8>>>,
}

impl Clients {
    pub fn new(scripts: &[Vec<Op>]) -> Clients {
        Clients {
            next_op: vec![0; scripts.len()],
            busy: vec![false; scripts.len()],
            testers: vec![LinearizabilityTester::new(Register(0)); KEYS],
        }
    }

    /// The clients that may invoke their next operation.
    pub fn ready<'a>(&'a self, scripts: &'a [Vec<Op>]) -> impl Iterator<Item = usize> + 'a {
        scripts
            .iter()
            .enumerate()
            .filter(|&(c, script)| !self.busy[c] && self.next_op[c] < script.len())
            .map(|(c, _)| c)
    }

    /// Client `c` invokes its next operation, which it returns.
    pub fn invoke(&mut self, scripts: &[Vec<Op>], c: usize) -> Op {
        let op = scripts[c][self.next_op[c]];
        let register_op = match op {
            Op::Write(_, value) => RegisterOp::Write(value),
            Op::Read(_) => RegisterOp::Read,
        };
        // The history is valid by construction (one operation in flight per client).
        let _ = self.testers[op.key()].on_invoke(c, register_op);
        self.busy[c] = true;
        op
    }

    /// Client `client`'s operation on `key` is answered `ret`.
    pub fn reply(&mut self, client: usize, key: usize, ret: RegisterRet<u8>) {
        let _ = self.testers[key].on_return(client, ret);
        self.busy[client] = false;
        self.next_op[client] += 1;
    }

    /// Whether every key's history so far is linearizable.
    pub fn linearizable(&self) -> bool {
        self.testers
            .iter()
            .all(|t| t.serialized_history().is_some())
    }

    /// Whether some operation was answered and none is in flight.
    pub fn answered_and_idle(&self) -> bool {
        self.testers.iter().any(|t| t.len() > 0) && self.busy.iter().all(|b| !b)
    }

    /// Whether every client ran its whole script.
    pub fn finished(&self, scripts: &[Vec<Op>]) -> bool {
        self.next_op
            .iter()
            .zip(scripts)
            .all(|(&next, script)| next == script.len())
    }
}

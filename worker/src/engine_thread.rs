//! The shell every worker's engine thread lives in, whatever its role: the inbox its handles
//! send to, the state they share with the thread, and the thread itself.

use crate::load::{LoadCell, QueueSlots};
use crossbeam_channel::{Receiver, Sender};
use kvmesh_common::NodeId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle engine thread, woken by a request, waits for others before its first
/// step (a worker's `gather_window` by default). Requests sent together (a closed loop's
/// clients when their answers end in one step, a burst, one router's requests fanned out)
/// arrive spread over a millisecond or so; a step started with the first alone makes the
/// rest wait for it, which on a CPU is a whole prefill (100 ms and more), so two
/// milliseconds buy the others that step. A busy thread never waits: new requests join its
/// next step.
pub const GATHER_WINDOW: Duration = Duration::from_millis(2);

/// Blocks until one of `sel`'s operations is ready or `deadline` passes (none: until one is).
pub fn ready_until(sel: &mut crossbeam_channel::Select<'_>, deadline: Option<Instant>) {
    match deadline {
        Some(d) => {
            let _ = sel.ready_deadline(d);
        }
        None => {
            sel.ready();
        }
    }
}

/// An engine thread's loop as far as waiting for work goes.
pub trait Gather {
    /// Takes everything that has arrived; false when the thread must stop.
    fn receive(&mut self) -> bool;

    /// Blocks until something arrives or `deadline` passes.
    fn wait(&mut self, deadline: Option<Instant>);

    /// Takes what arrives within `window` (see [`GATHER_WINDOW`]), so requests sent
    /// together start in one step. False when the thread must stop.
    fn gather(&mut self, window: Duration) -> bool {
        let until = Instant::now() + window;
        while Instant::now() < until {
            if !self.receive() {
                return false;
            }
            self.wait(Some(until));
        }
        true
    }
}

/// The messages every worker's inbox carries besides its role's own.
pub trait Control: Send + 'static {
    /// Wakes the thread to notice a drain.
    fn wake() -> Self;
    /// Stops the thread: the requests still open end with `Unavailable`.
    fn stop() -> Self;
}

/// A worker's inbox. It is far larger than the queue bound (`max_queued_requests`), so a
/// `try_send` fails only when the thread is gone.
pub fn inbox<M>(max_queued_requests: usize) -> (Sender<M>, Receiver<M>) {
    crossbeam_channel::bounded(max_queued_requests.saturating_mul(2) + 16)
}

/// What a worker's handles and its thread share; `role` holds what the role adds.
#[derive(Debug)]
pub struct NodeState<R> {
    pub node_id: NodeId,
    /// Blocks in the KV pool (what the node announces in its `NodeInfo`).
    pub kv_blocks_total: usize,
    /// Requests accepted and not yet admitted: handles take slots, the thread gives them back.
    pub queue: QueueSlots,
    /// What the thread last published.
    pub load: LoadCell,
    draining: AtomicBool,
    pub role: R,
}

impl<R> NodeState<R> {
    pub fn new(
        node_id: NodeId,
        kv_blocks_total: usize,
        max_queued_requests: usize,
        role: R,
    ) -> Self {
        NodeState {
            node_id,
            kv_blocks_total,
            queue: QueueSlots::new(max_queued_requests),
            load: LoadCell::default(),
            draining: AtomicBool::new(false),
            role,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Stops accepting requests and wakes the thread (through `inbox`), which finishes those
    /// accepted and exits.
    pub fn drain<M: Control>(&self, inbox: &Sender<M>) {
        self.draining.store(true, Ordering::Release);
        let _ = inbox.try_send(M::wake());
    }
}

/// The methods every node's handle offers over its engine thread's [`NodeState`] (field
/// `shared`) and inbox (field `inbox`), written once for the decode and the prefill handle:
/// expand inside the handle's `impl`.
#[macro_export]
macro_rules! node_handle_methods {
    () => {
        /// What the engine thread last published.
        pub fn load(&self) -> ::kvmesh_common::LoadReport {
            self.shared.load.get()
        }

        /// Blocks in the node's KV pool.
        pub fn kv_blocks_total(&self) -> usize {
            self.shared.kv_blocks_total
        }

        pub fn is_draining(&self) -> bool {
            self.shared.is_draining()
        }

        /// Stops accepting requests; those accepted are finished, then the thread exits.
        pub fn drain(&self) {
            self.shared.drain(&self.inbox);
        }
    };
}

/// Owns a worker's engine thread. Dropping it stops the thread (the requests still open end
/// with `Unavailable`) and waits for it; drain first, then `join` or `join_within`, to let
/// them finish.
pub struct EngineThread<M: Control> {
    inbox: Sender<M>,
    thread: Option<JoinHandle<()>>,
}

impl<M: Control> EngineThread<M> {
    /// Starts `run` on a thread called `name`; `inbox` is where it reads its messages.
    pub fn spawn(
        name: String,
        inbox: Sender<M>,
        run: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<Self> {
        let thread = std::thread::Builder::new().name(name).spawn(run)?;
        Ok(EngineThread {
            inbox,
            thread: Some(thread),
        })
    }

    /// Waits for the thread to exit (after a drain, once the open requests are finished).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Waits up to `timeout` for the thread to exit (after a drain); past it, stops the
    /// thread, ending the requests still open with `Unavailable`. Returns whether they all
    /// finished in time.
    pub fn join_within(mut self, timeout: Duration) -> bool {
        let Some(t) = self.thread.take() else {
            return true;
        };
        let inbox = self.inbox.clone();
        kvmesh_common::shutdown::join_within(t, timeout, move || {
            let _ = inbox.send(M::stop());
        })
    }
}

impl<M: Control> Drop for EngineThread<M> {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = self.inbox.send(M::stop());
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    enum Msg {
        Wake,
        Stop,
    }

    impl Control for Msg {
        fn wake() -> Self {
            Msg::Wake
        }
        fn stop() -> Self {
            Msg::Stop
        }
    }

    /// A thread that keeps running until told to stop (it ignores wake-ups).
    fn stubborn() -> (EngineThread<Msg>, Receiver<&'static str>) {
        let (tx, rx) = inbox::<Msg>(1);
        let (said_tx, said_rx) = crossbeam_channel::unbounded();
        let thread = EngineThread::spawn("test".into(), tx, move || {
            while let Ok(msg) = rx.recv() {
                match msg {
                    Msg::Wake => said_tx.send("woken").unwrap(),
                    Msg::Stop => break,
                }
            }
            said_tx.send("stopped").unwrap();
        })
        .unwrap();
        (thread, said_rx)
    }

    #[test]
    fn a_drain_wakes_the_thread_and_a_missed_deadline_stops_it() {
        let (thread, said) = stubborn();
        let state = NodeState::new(NodeId(1), 16, 4, ());
        assert!(!state.is_draining());
        state.drain(&thread.inbox);
        assert!(state.is_draining());
        assert_eq!(said.recv().unwrap(), "woken");
        assert!(!thread.join_within(Duration::from_millis(10)));
        assert_eq!(said.recv().unwrap(), "stopped");
    }

    #[test]
    fn dropping_the_owner_stops_the_thread() {
        let (thread, said) = stubborn();
        drop(thread);
        assert_eq!(said.try_recv().unwrap(), "stopped");
    }
}

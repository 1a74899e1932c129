//! Stopping a worker thread within a deadline.

use std::thread::JoinHandle;
use std::time::Duration;

/// Waits up to `timeout` for `thread` to exit; if it has not by then, calls `stop` (which must
/// make it exit) and waits for that. Returns whether it exited on its own.
pub fn join_within(thread: JoinHandle<()>, timeout: Duration, stop: impl FnOnce()) -> bool {
    let (done, exited) = std::sync::mpsc::channel();
    let joiner = std::thread::spawn(move || {
        let _ = thread.join();
        let _ = done.send(());
    });
    let on_its_own = exited.recv_timeout(timeout).is_ok();
    if !on_its_own {
        stop();
    }
    let _ = joiner.join();
    on_its_own
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_thread_that_exits_in_time_is_not_stopped() {
        let t = std::thread::spawn(|| {});
        assert!(join_within(t, Duration::from_secs(10), || panic!(
            "stopped"
        )));
    }

    #[test]
    fn a_thread_still_busy_at_the_deadline_is_stopped() {
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let _ = stop_rx.recv();
        });
        assert!(!join_within(t, Duration::from_millis(50), move || {
            stop_tx.send(()).unwrap()
        }));
    }
}

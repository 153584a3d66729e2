//! A server running on its own tokio runtime thread, stopped on drop.

use tokio::sync::oneshot;

/// The thread of a daemon or registry and the switch that stops it.
#[derive(Debug)]
pub(crate) struct ServiceThread {
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServiceThread {
    /// Wraps a thread that stops when `shutdown`'s receiver fires.
    pub(crate) fn new(shutdown: oneshot::Sender<()>, thread: std::thread::JoinHandle<()>) -> Self {
        ServiceThread { shutdown: Some(shutdown), thread: Some(thread) }
    }

    /// Blocks until the thread ends on its own.
    pub(crate) fn wait(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Signals shutdown and joins.
    pub(crate) fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.wait();
    }
}

impl Drop for ServiceThread {
    fn drop(&mut self) {
        self.stop();
    }
}

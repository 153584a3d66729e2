//! A stop flag every loop checks, with an interruptible sleep, wired to
//! SIGTERM and SIGINT.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Cloneable handle to one stop flag.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    flag: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Shutdown {
    /// A flag that is not yet set.
    pub fn new() -> Shutdown {
        Shutdown::default()
    }

    /// Sets the flag and wakes every [`Shutdown::sleep`].
    pub fn trigger(&self) {
        self.inner.flag.store(true, Ordering::SeqCst);
        let _guard = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.wake.notify_all();
    }

    /// Whether the flag is set.
    pub fn is_triggered(&self) -> bool {
        self.inner.flag.load(Ordering::Relaxed)
    }

    /// Sleeps for `d` or until the flag is set; returns whether it is set.
    pub fn sleep(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut guard = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
        while !self.is_triggered() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            guard = match self.inner.wake.wait_timeout(guard, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        self.is_triggered()
    }

    /// Triggers the flag on SIGTERM or SIGINT (from a small thread, since a
    /// signal handler may not take locks). Returns the signal thread.
    pub fn on_signals(&self) -> std::io::Result<std::thread::JoinHandle<()>> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
        let this = self.clone();
        std::thread::Builder::new().name("evict-signals".into()).spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!(signal = sig, "stop requested; finishing the current batch");
                this.trigger();
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_wakes_a_sleeper() {
        let s = Shutdown::new();
        let t = {
            let s = s.clone();
            std::thread::spawn(move || s.sleep(Duration::from_secs(600)))
        };
        s.trigger();
        assert!(t.join().unwrap());
        assert!(!Shutdown::new().sleep(Duration::from_millis(1)));
    }
}

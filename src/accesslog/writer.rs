//! The access-log writer: lines are queued by the data path and written to stdout by a
//! thread of their own, so a request never waits on a stdout write.

use std::io::Write;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::metrics;

/// Lines waiting for stdout, with the writer thread's wake-up.
struct Shared {
    queue: Mutex<LineQueue>,
    wake: Condvar,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(writer)
            .ok();
        Shared {
            queue: Mutex::new(LineQueue::default()),
            wake: Condvar::new(),
        }
    })
}

fn lock_queue() -> std::sync::MutexGuard<'static, LineQueue> {
    shared().queue.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writer thread: flushes every [`FLUSH_EVERY`], or as soon as [`FLUSH_AT`] bytes wait.
fn writer() {
    loop {
        {
            let q = lock_queue();
            let _ = shared()
                .wake
                .wait_timeout_while(q, FLUSH_EVERY, |q| q.lines.len() < FLUSH_AT);
        }
        flush();
    }
}

/// The longest a line waits for stdout when traffic is light.
const FLUSH_EVERY: Duration = Duration::from_millis(50);

/// Queued bytes that wake the writer before [`FLUSH_EVERY`]: on a busy sidecar a whole
/// interval's lines are hundreds of KiB, and a buffer grown to that (twice: one filling while
/// the other is written) would be the largest single block of its heap.
const FLUSH_AT: usize = 32 * 1024;

/// What a buffer starts with and what the spare is cut back to after a backlog, so a burst
/// while stdout was slow does not stay resident.
const KEEP: usize = 2 * FLUSH_AT;

/// Two buffers that trade places: lines fill one while the writer empties the other, and the
/// emptied one comes back as the spare, so a steady stream allocates nothing.
#[derive(Default)]
struct LineQueue {
    lines: Vec<u8>,
    spare: Vec<u8>,
}

/// What [`LineQueue::push`] did with a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pushed {
    Queued,
    /// Queued, and the queue has just reached [`FLUSH_AT`]: wake the writer.
    QueuedWake,
    /// Over [`MAX_BUFFERED`]: dropped (stdout is not keeping up).
    Dropped,
}

impl LineQueue {
    fn push(&mut self, line: &[u8]) -> Pushed {
        let before = self.lines.len();
        if before + line.len() > MAX_BUFFERED {
            return Pushed::Dropped;
        }
        if self.lines.capacity() == 0 {
            self.lines.reserve(KEEP);
        }
        self.lines.extend_from_slice(line);
        if before < FLUSH_AT && self.lines.len() >= FLUSH_AT {
            Pushed::QueuedWake
        } else {
            Pushed::Queued
        }
    }

    fn queued(&self) -> usize {
        self.lines.len()
    }

    /// Everything queued, for the writer; the spare takes its place.
    fn take(&mut self) -> Vec<u8> {
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.lines, spare)
    }

    /// A written buffer back, emptied, as the next spare.
    fn give_back(&mut self, mut buf: Vec<u8>) {
        buf.clear();
        buf.shrink_to(KEEP);
        if buf.capacity() > self.spare.capacity() {
            self.spare = buf;
        }
    }
}

/// Most bytes of lines waiting for stdout; past it, lines are dropped (and counted). 1 MiB holds
/// a few thousand lines, far more than 50 ms of traffic when stdout keeps up.
const MAX_BUFFERED: usize = 1 << 20;

pub(super) fn push_line(mut line: Vec<u8>) {
    line.push(b'\n');
    queue_line(&line);
}

/// Queues a whole line, newline included.
pub(super) fn queue_line(line: &[u8]) {
    let pushed = lock_queue().push(line);
    match pushed {
        Pushed::Queued => {}
        Pushed::QueuedWake => shared().wake.notify_one(),
        Pushed::Dropped => {
            metrics::metrics().access_log_dropped.inc();
        }
    }
}

/// Writes out queued lines; called by the writer thread. Only that thread (and
/// [`flush_at_exit`]) ever waits on stdout; the queue lock is not held while writing.
fn flush() {
    let data = {
        let mut q = lock_queue();
        if q.queued() == 0 {
            return;
        }
        q.take()
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&data);
    let _ = out.flush();
    drop(out);
    lock_queue().give_back(data);
}

/// The last flush before exit, waiting at most `limit`: a stuck stdout must not keep a
/// drained proxy from exiting.
pub fn flush_at_exit(limit: Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("access-log-exit".into())
        .spawn(move || {
            flush();
            let _ = tx.send(());
        });
    if spawned.is_ok() {
        let _ = rx.recv_timeout(limit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_wakes_the_writer_once_per_fill_and_reuses_its_buffers() {
        let line = [b'x'; 400];
        let mut q = LineQueue::default();
        let mut wakes = 0;
        for _ in 0..FLUSH_AT / line.len() + 1 {
            match q.push(&line) {
                Pushed::QueuedWake => wakes += 1,
                Pushed::Queued => {}
                Pushed::Dropped => panic!("dropped below the cap"),
            }
        }
        assert_eq!(wakes, 1, "one wake-up when the queue reaches FLUSH_AT");
        assert!(q.queued() >= FLUSH_AT);

        // Steady traffic: the two buffers trade places and nothing grows or is allocated.
        let first = q.take();
        let (a, cap) = (first.as_ptr(), first.capacity());
        q.give_back(first);
        q.push(&line);
        let second = q.take();
        let b = second.as_ptr();
        assert_ne!(a, b);
        q.give_back(second);
        q.push(&line);
        let third = q.take();
        assert_eq!(
            third.as_ptr(),
            a,
            "the written buffer came back as the spare"
        );
        assert_eq!(third.capacity(), cap);
        assert!(cap <= KEEP, "{cap}");
        q.give_back(third);

        // A backlog (stdout stalled) grows a buffer up to the cap; past it lines are dropped,
        // and once written the grown buffer is cut back.
        let mut dropped = 0;
        while dropped == 0 {
            if q.push(&line) == Pushed::Dropped {
                dropped += 1;
            }
        }
        assert!(q.queued() <= MAX_BUFFERED && q.queued() + line.len() > MAX_BUFFERED);
        let big = q.take();
        assert!(big.capacity() >= MAX_BUFFERED / 2);
        q.give_back(big);
        assert_eq!(q.queued(), 0);
        q.push(&line);
        assert!(q.take().capacity() <= KEEP);
    }
}

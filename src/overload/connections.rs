//! Client connections that step 2 may close, and which of them is idlest.
//!
//! Only kept while a limit is in force. Idleness is read from the kernel (`TCP_INFO`'s time
//! since data last arrived) when it is needed, so the data path records nothing per read.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Each entered connection's socket, and how to ask it to close.
type Table = Mutex<HashMap<u64, (RawFd, Arc<Notify>)>>;

fn table() -> &'static Table {
    static TABLE: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// A client connection in the table for as long as this lives.
pub struct Watched {
    id: u64,
    close: Arc<Notify>,
}

impl Watched {
    pub fn new(socket: &impl AsRawFd) -> Watched {
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(Notify::new());
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (socket.as_raw_fd(), close.clone()));
        Watched { id, close }
    }

    /// Resolves when step 2 chose this connection to close.
    pub async fn closed(&self) {
        self.close.notified().await
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        table()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// Connections in the table.
pub fn count() -> usize {
    table().lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// Asks the `n` connections that have gone longest without receiving data to close; returns
/// how many were asked.
pub fn close_idlest(n: usize) -> usize {
    let all: Vec<(RawFd, Arc<Notify>)> = table()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .cloned()
        .collect();
    let mut ranked: Vec<(u32, Arc<Notify>)> = all
        .into_iter()
        .map(|(fd, close)| (idle_ms(fd).unwrap_or(u32::MAX), close))
        .collect();
    ranked.sort_unstable_by_key(|(idle, _)| std::cmp::Reverse(*idle));
    ranked.truncate(n);
    for (_, close) in &ranked {
        close.notify_one();
    }
    ranked.len()
}

/// Milliseconds since the socket last received data, from the kernel.
fn idle_ms(fd: RawFd) -> Option<u32> {
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a writable tcp_info of `len` bytes; the kernel writes at most `len`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    // SAFETY: zeroed above and filled by the kernel on success.
    (r == 0).then(|| unsafe { info.assume_init() }.tcpi_last_data_recv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn the_connection_idle_longest_is_asked_to_close_first() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut quiet_client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (quiet, _) = listener.accept().await.unwrap();
        quiet_client.write_all(b"x").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let mut busy_client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (busy, _) = listener.accept().await.unwrap();
        busy_client.write_all(b"y").await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;

        assert!(idle_ms(quiet.as_raw_fd()).unwrap() >= 250);
        let (wq, wb) = (Watched::new(&quiet), Watched::new(&busy));
        // Other tests' connections may share the table; this one closes only the idlest.
        let before = count();
        assert!(before >= 2);
        let asked = close_idlest(1);
        assert_eq!(asked, 1);
        let quiet_closed = tokio::time::timeout(std::time::Duration::from_millis(200), wq.closed());
        assert!(
            quiet_closed.await.is_ok(),
            "the quiet connection was not asked"
        );
        let busy_closed = tokio::time::timeout(std::time::Duration::from_millis(100), wb.closed());
        assert!(busy_closed.await.is_err(), "the busy connection was asked");
        drop((wq, wb));
        assert_eq!(count(), before - 2);
    }
}

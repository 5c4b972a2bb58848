//! The floor for scenario g of the side-by-side bench (1 GiB through a raw TCP port of the
//! pair): what one sidecar's share of the work costs on this machine when nothing else is
//! done. A sidecar on that path reads every byte from one TCP connection, passes it once
//! through AES-128-GCM (sealing on the server side, opening on the client side, in TLS
//! records of 16 KiB) and writes it to another. This program does exactly that, with
//! BoringSSL's AEAD interface (what BoringSSL's own TLS code calls) and plain blocking
//! sockets on loopback, and reports the CPU time of the thread doing it (user + system, from
//! `getrusage(RUSAGE_THREAD)`), in seconds a GiB:
//!
//! - `seal`: the AES-128-GCM pass alone, 16 KiB records, in memory;
//! - `copy`: a relay thread reading from one loopback connection into a buffer of the pump's
//!   bulk size (`sockets::pump::BULK`) and writing it to another;
//! - `relay+seal`: the same relay sealing each record of what it read before writing it:
//!   one sidecar's floor.
//!
//! Each part runs `ROUNDS` times (default 3) over `MIB` MiB (default 1024); the median is
//! printed. Not a criterion bench: it measures CPU time, not wall time, and the figures are
//! read against `run.sh`'s CPU per GiB (benches/README.md, "The floor for g").
//!
//!   cargo bench --bench tcp_floor

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;

use aether_proxy::sockets::{BULK, RECORD};
use boring_sys as ffi;

/// The AES-GCM tag BoringSSL appends to each sealed record.
const TAG: usize = 16;

fn main() {
    let mib: usize = env_or("MIB", 1024);
    let rounds: usize = env_or("ROUNDS", 3);
    let bytes = mib << 20;
    println!("{mib} MiB a round, {rounds} rounds, median CPU seconds a GiB (user + system):");
    let seal = median((0..rounds).map(|_| seal_only(bytes)).collect());
    println!(
        "  seal        {seal:.3}  (AES-128-GCM, {} KiB records)",
        RECORD >> 10
    );
    let copy = median((0..rounds).map(|_| relay(bytes, false)).collect());
    println!(
        "  copy        {copy:.3}  (read + write, {} KiB buffer)",
        BULK >> 10
    );
    let both = median((0..rounds).map(|_| relay(bytes, true)).collect());
    println!("  relay+seal  {both:.3}  (one sidecar's floor)");
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// This thread's CPU time so far, user + system, in seconds.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is valid on Linux.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    assert_eq!(rc, 0, "getrusage");
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn per_gib(cpu: f64, bytes: usize) -> f64 {
    cpu * (1u64 << 30) as f64 / bytes as f64
}

/// An AES-128-GCM sealing context, as BoringSSL's TLS code keeps one per direction.
struct Sealer {
    ctx: *mut ffi::EVP_AEAD_CTX,
    seq: u64,
}

impl Sealer {
    fn new() -> Sealer {
        let key = [7u8; 16];
        // SAFETY: the AEAD is a static; the key is 16 bytes, as AES-128-GCM needs; the tag
        // length is the default's.
        let ctx = unsafe {
            ffi::EVP_AEAD_CTX_new(ffi::EVP_aead_aes_128_gcm(), key.as_ptr(), key.len(), TAG)
        };
        assert!(!ctx.is_null(), "EVP_AEAD_CTX_new");
        Sealer { ctx, seq: 0 }
    }

    /// Seals `plain` into `out` (at least `plain.len() + TAG` bytes) with a fresh nonce and a
    /// TLS-like additional data block; returns the sealed length.
    fn seal(&mut self, plain: &[u8], out: &mut [u8]) -> usize {
        self.seq += 1;
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.seq.to_be_bytes());
        let mut ad = [0u8; 13];
        ad[..8].copy_from_slice(&self.seq.to_be_bytes());
        ad[8] = 23;
        ad[11..].copy_from_slice(&(plain.len() as u16).to_be_bytes());
        let mut len = 0usize;
        // SAFETY: every pointer is valid for the length passed with it; `out` has room for
        // the plaintext and the tag (checked by BoringSSL against `max_out_len`).
        let ok = unsafe {
            ffi::EVP_AEAD_CTX_seal(
                self.ctx,
                out.as_mut_ptr(),
                &mut len,
                out.len(),
                nonce.as_ptr(),
                nonce.len(),
                plain.as_ptr(),
                plain.len(),
                ad.as_ptr(),
                ad.len(),
            )
        };
        assert_eq!(ok, 1, "EVP_AEAD_CTX_seal");
        len
    }
}

impl Drop for Sealer {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from EVP_AEAD_CTX_new and is freed once.
        unsafe { ffi::EVP_AEAD_CTX_free(self.ctx) };
    }
}

fn seal_only(bytes: usize) -> f64 {
    let mut sealer = Sealer::new();
    let plain = vec![1u8; RECORD];
    let mut out = vec![0u8; RECORD + TAG];
    let start = thread_cpu();
    let mut done = 0;
    while done < bytes {
        std::hint::black_box(sealer.seal(&plain, &mut out));
        done += RECORD;
    }
    per_gib(thread_cpu() - start, bytes)
}

/// source -> relay -> sink over loopback; returns the relay thread's CPU a GiB.
fn relay(bytes: usize, seal: bool) -> f64 {
    let into = TcpListener::bind("127.0.0.1:0").unwrap();
    let out = TcpListener::bind("127.0.0.1:0").unwrap();
    let (into_addr, out_addr) = (into.local_addr().unwrap(), out.local_addr().unwrap());
    let source = thread::spawn(move || {
        let mut s = TcpStream::connect(into_addr).unwrap();
        let chunk = vec![1u8; BULK];
        let mut sent = 0;
        while sent < bytes {
            let n = chunk.len().min(bytes - sent);
            s.write_all(&chunk[..n]).unwrap();
            sent += n;
        }
    });
    let sink = thread::spawn(move || {
        let (mut s, _) = out.accept().unwrap();
        let mut buf = vec![0u8; BULK];
        let mut got = 0usize;
        loop {
            match s.read(&mut buf).unwrap() {
                0 => break got,
                n => got += n,
            }
        }
    });
    let relay = thread::spawn(move || {
        let (mut from, _) = into.accept().unwrap();
        let mut to = TcpStream::connect(out_addr).unwrap();
        let mut sealer = Sealer::new();
        let mut buf = vec![0u8; BULK];
        let mut sealed = vec![0u8; BULK + (BULK / RECORD + 1) * TAG];
        let start = thread_cpu();
        loop {
            let n = from.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            if seal {
                let mut len = 0;
                for record in buf[..n].chunks(RECORD) {
                    len += sealer.seal(record, &mut sealed[len..]);
                }
                to.write_all(&sealed[..len]).unwrap();
            } else {
                to.write_all(&buf[..n]).unwrap();
            }
        }
        let cpu = thread_cpu() - start;
        drop(to);
        cpu
    });
    source.join().unwrap();
    let cpu = relay.join().unwrap();
    let got = sink.join().unwrap();
    let expected = if seal {
        bytes + bytes.div_ceil(RECORD) * TAG
    } else {
        bytes
    };
    // Reads may split records differently, so the sealed count is at least the plaintext plus
    // one tag a record.
    assert!(
        got >= expected,
        "sink got {got} bytes, expected at least {expected}"
    );
    per_gib(cpu, bytes)
}

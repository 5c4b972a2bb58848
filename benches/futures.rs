//! Boxing a large future: `Box::pin(fut)` against `memory::box_future(|| fut)`, which builds it
//! in its box. The future keeps a 4 KiB state across an await, about the size of the outbound
//! exchange's (retries, the pool, hyper's send); it is built, boxed, polled to its end and
//! freed, as each proxied request's is. The difference is the copy of its whole state.

use std::future::Future;
use std::hint::black_box;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use aether_proxy::memory::box_future;
use criterion::{criterion_group, criterion_main, Criterion};

/// Pending once, then ready: a state with the buffer in it is kept across the await.
struct Once(bool);

impl Future for Once {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Ready(())
        } else {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

/// Like the exchange, a large state of which each step touches little (hyper's buffers, the
/// pool's and the retries' states): uninitialised until used.
async fn exchange(seed: u8) -> u8 {
    let mut state = [const { std::mem::MaybeUninit::<u8>::uninit() }; 4096];
    state[0].write(seed);
    Once(false).await;
    state[4095].write(seed.wrapping_add(1));
    // SAFETY: both bytes read were written above.
    unsafe { black_box(&state)[4095].assume_init() ^ state[0].assume_init() }
}

fn run<F: Future<Output = u8>>(mut fut: Pin<Box<F>>) -> u8 {
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// Made out of line, as the proxy's futures are where they are boxed (their construction sits
/// in another function's body): the value comes back through a return slot.
#[inline(never)]
fn make(seed: u8) -> impl Future<Output = u8> {
    exchange(seed)
}

fn boxing(c: &mut Criterion) {
    let mut g = c.benchmark_group("box a 4 KiB future, poll it to its end");
    g.bench_function("Box::pin", |b| b.iter(|| run(Box::pin(make(black_box(1))))));
    g.bench_function("box_future (built in its box)", |b| {
        b.iter(|| run(box_future(|| make(black_box(1)))))
    });
    g.finish();
}

criterion_group!(benches, boxing);
criterion_main!(benches);

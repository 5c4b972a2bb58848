//! Futures boxed where they are built.

/// Boxes the future `make` builds, building it in the box. `Box::pin(fut)` builds the future
/// on the stack and then copies all of it into the heap: its size is that of its largest
/// state, several KiB for an exchange with the pool and retries in it, although only its
/// arguments are set when it is made. Written into the box, only those are stored (the
/// optimiser builds the value in place once the closure is inlined).
#[inline(always)]
pub fn box_future<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    let mut slot = Box::<F>::new_uninit();
    slot.write(make());
    // SAFETY: written just above.
    Box::into_pin(unsafe { slot.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_future_built_in_its_box_runs_once_and_drops_what_it_holds() {
        struct Counted(std::rc::Rc<std::cell::Cell<u32>>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.set(self.0.get() + 1);
            }
        }
        let drops = std::rc::Rc::new(std::cell::Cell::new(0));
        let held = Counted(drops.clone());
        // A future with a large state (a buffer kept across an await), as the exchange's is.
        let fut = box_future(|| async move {
            let mut big = [0u8; 4096];
            tokio::task::yield_now().await;
            big[4095] = 7;
            let _keep = &held;
            big.iter().map(|&b| b as u32).sum::<u32>()
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert_eq!(rt.block_on(fut), 7);
        assert_eq!(drops.get(), 1);
        // Dropped before it is polled, it drops what it captured too.
        let held = Counted(drops.clone());
        drop(box_future(|| async move { drop(held) }));
        assert_eq!(drops.get(), 2);
    }
}

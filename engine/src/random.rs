//! Seeded draws from libtorch's default generators, one seeded section at a time.
//!
//! libtorch keeps one default generator per device for the whole process, and
//! `tch::manual_seed` reseeds them all. A job that seeds them and then draws its initial
//! weights gets the same weights every time only if no other thread reseeds them or draws from
//! them in between: two jobs in one process (the test harness runs a binary's tests on several
//! threads) would otherwise take each other's draws. Every seeded section of the suite goes
//! through [`seeded`], which holds one process-wide lock from the seed to its last draw.
use std::sync::Mutex;

static GENERATORS: Mutex<()> = Mutex::new(());

/// `f()` with libtorch's default generators seeded to `seed`, no other seeded section running
/// meanwhile. `f` must not call [`seeded`] itself (the lock is not reentrant).
pub fn seeded<T>(seed: i64, f: impl FnOnce() -> T) -> T {
    // A section that panicked left nothing half-done that the next seed does not reset.
    let _alone = GENERATORS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn sections_seeded_alike_draw_alike_while_other_threads_draw() {
        let draw = || seeded(5, || Tensor::randn([64], (Kind::Float, Device::Cpu)));
        let reference = draw();
        let others: Vec<_> = (0..4)
            .map(|i| {
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _ = seeded(i, || Tensor::randn([64], (Kind::Float, Device::Cpu)));
                    }
                })
            })
            .collect();
        for _ in 0..200 {
            assert!(draw().equal(&reference), "a section seeded with 5 drew other numbers");
        }
        for o in others {
            o.join().unwrap();
        }
    }
}

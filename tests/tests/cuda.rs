//! CUDA streams, events, allocator statistics and the memory cap. These need a GPU: without
//! one each test returns early with a notice, or fails under `SUITE_REQUIRE_CUDA=1` (the
//! CPU-only behaviour is checked in faults.rs).
use engine::cuda::{self, Event, Stream};
use tch::{Device, Kind, Tensor};

fn gpu() -> Option<usize> {
    suite_tests::cuda_devices(1, "this CUDA test").then_some(0)
}

#[test]
fn require_cuda_turns_a_missing_gpu_into_a_failure() {
    if cuda::is_available() {
        return; // Nothing to check: the GPU tests run for real here.
    }
    // This binary's own GPU test, run again with the switch set: it must fail, naming why.
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["allocator_statistics_track_tensors", "--exact", "--test-threads=1"])
        .env(suite_tests::REQUIRE_CUDA_ENV, "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "a GPU test passed without a GPU under SUITE_REQUIRE_CUDA=1:\n{text}");
    assert!(text.contains("needs 1 CUDA device(s), found 0") && text.contains("SUITE_REQUIRE_CUDA=1"), "{text}");
}

#[test]
fn side_stream_work_is_ordered_by_events() {
    let Some(dev) = gpu() else { return };
    let main = Stream::current(dev).unwrap();
    let side = Stream::from_pool(dev, false).unwrap();
    assert_ne!(main.id(), side.id(), "a pool stream is not the current stream");
    let x = Tensor::ones([1024, 1024], (Kind::Float, Device::Cuda(dev)));
    let ready = Event::new(false).unwrap();
    ready.record(&main).unwrap();
    side.wait_event(&ready).unwrap();
    side.set_current().unwrap();
    let y = x.matmul(&x);
    side.record_tensor(&y).unwrap();
    let done = Event::new(true).unwrap();
    done.record(&side).unwrap();
    main.set_current().unwrap();
    main.wait_event(&done).unwrap();
    done.synchronize().unwrap();
    assert!(done.query().unwrap() && side.query().unwrap());
    assert_eq!(y.double_value(&[0, 0]), 1024.0);
    let start = Event::new(true).unwrap();
    start.record(&main).unwrap();
    let _ = x.matmul(&x);
    let end = Event::new(true).unwrap();
    end.record(&main).unwrap();
    end.synchronize().unwrap();
    assert!(start.elapsed_ms(&end).unwrap() >= 0.0);
}

#[test]
fn allocator_statistics_track_tensors() {
    let Some(dev) = gpu() else { return };
    cuda::synchronize(dev).unwrap();
    cuda::reset_peak_stats(dev).unwrap();
    let before = cuda::memory_stats(dev).unwrap();
    let t = Tensor::zeros([64, 1024, 1024], (Kind::Float, Device::Cuda(dev))); // 256 MiB
    let during = cuda::memory_stats(dev).unwrap();
    assert!(during.allocated - before.allocated >= 256 << 20, "{before:?} -> {during:?}");
    drop(t);
    let after = cuda::memory_stats(dev).unwrap();
    assert!(after.allocated < during.allocated);
    assert!(after.peak_allocated >= during.allocated);
    let (free, total) = cuda::mem_get_info(dev).unwrap();
    assert!(free <= total && total > 0);
}

#[test]
fn memory_cap_turns_large_allocations_into_errors() {
    let Some(dev) = gpu() else { return };
    cuda::empty_cache().unwrap();
    cuda::set_memory_cap(1 << 30, dev).unwrap(); // 1 GiB
    let small = Tensor::f_zeros([128, 1024, 1024], (Kind::Float, Device::Cuda(dev))); // 512 MiB
    assert!(small.is_ok(), "512 MiB fits under a 1 GiB cap");
    drop(small);
    let big = Tensor::f_zeros([512, 1024, 1024], (Kind::Float, Device::Cuda(dev))); // 2 GiB
    assert!(big.is_err(), "2 GiB must not fit under a 1 GiB cap");
    assert!(cuda::memory_stats(dev).unwrap().ooms >= 1);
    cuda::set_memory_fraction(1.0, dev).unwrap();
    let err = cuda::set_memory_cap(u64::MAX, dev).unwrap_err();
    assert!(err.to_string().contains("exceeds cuda:0"), "{err}");
}

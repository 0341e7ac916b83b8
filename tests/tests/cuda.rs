//! CUDA streams, events, allocator statistics and the memory cap. These need a GPU: without
//! one each test returns early with a notice, or fails under `SUITE_REQUIRE_CUDA=1` (the
//! CPU-only behaviour is checked in faults.rs).
use std::sync::{Mutex, MutexGuard};

use engine::cuda::{self, Event, Stream};
use engine::gemini::{ChunkConfig, ChunkManager, Event as ChunkEvent, Tier};
use engine::optim::Param;
use tch::{Device, Kind, Tensor};

/// The GPU, to one test at a time: the tests read the process's allocator statistics, cap
/// its memory and time copies, which tests running beside them would disturb (a plain `cargo
/// test` runs them in parallel).
fn gpu() -> Option<(usize, MutexGuard<'static, ()>)> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    suite_tests::cuda_devices(1, "this CUDA test")
        .then(|| (0, ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())))
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

/// `upload_slice` copies the values into pinned memory by slices on every core (a tail shorter
/// than a slice included) and from there to the device: the device holds the values exactly,
/// for floats and for the labels' integers.
#[test]
fn upload_slice_lands_the_values_on_the_device() {
    let Some((dev, _one_at_a_time)) = gpu() else { return };
    let device = Device::Cuda(dev);
    let n = 3 * 1_000_001;
    let floats: Vec<f32> = (0..n).map(|i| (i % 9973) as f32 * 0.25 - 7.0).collect();
    let labels: Vec<i64> = (0..1000).map(|i| i * 7 % 1000).collect();
    let x = cuda::upload_slice(&floats, &[3, 1_000_001], device).unwrap();
    let y = cuda::upload_slice(&labels, &[1000], device).unwrap();
    cuda::synchronize(dev).unwrap();
    assert_eq!((x.device(), x.size()), (device, vec![3, 1_000_001]));
    assert!(x.to_device(Device::Cpu).equal(&Tensor::from_slice(&floats).view([3, 1_000_001])));
    assert!(y.to_device(Device::Cpu).equal(&Tensor::from_slice(&labels)));
}

/// The allocator's statistics, peak reset and cap work as a process's first CUDA calls:
/// libtorch initialises CUDA lazily at the first tensor, so the bridge must do it itself (the
/// Gemini cap comes before any tensor in `diffusion finetune --gpu-mem`). The test runs its
/// body in a fresh process of this binary.
#[test]
fn allocator_calls_work_before_any_tensor() {
    const CHILD: &str = "SUITE_FIRST_CUDA_CALL";
    let Some((dev, _one_at_a_time)) = gpu() else { return };
    if std::env::var_os(CHILD).is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["allocator_calls_work_before_any_tensor", "--exact", "--test-threads=1", "--nocapture"])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && text.contains("1 passed"), "in a fresh process:\n{text}");
        return;
    }
    cuda::reset_peak_stats(dev).unwrap();
    let stats = cuda::memory_stats(dev).unwrap();
    assert_eq!(stats.allocated, 0, "nothing allocated yet: {stats:?}");
    cuda::set_memory_cap(1 << 30, dev).unwrap();
    cuda::empty_cache().unwrap();
    let t = Tensor::zeros([1024], (Kind::Float, Device::Cuda(dev)));
    assert!(cuda::memory_stats(dev).unwrap().allocated >= 4096);
    drop(t);
}

#[test]
fn side_stream_work_is_ordered_by_events() {
    let Some((dev, _one_at_a_time)) = gpu() else { return };
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
    let Some((dev, _one_at_a_time)) = gpu() else { return };
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
    let Some((dev, _one_at_a_time)) = gpu() else { return };
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

/// Records a timing event on the current stream of `dev`.
fn mark(dev: usize) -> Event {
    let e = Event::new(true).unwrap();
    e.record(&Stream::current(dev).unwrap()).unwrap();
    e
}

/// Two trainable fp32 parameters of `numel` seeded random values.
fn two_params(numel: usize) -> Vec<Param> {
    (0..2)
        .map(|i| {
            tch::manual_seed(i);
            let t = Tensor::randn([numel as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            Param::new(format!("w{i}"), &t)
        })
        .collect()
}

/// A chunk manager on `device` holding `params` one per chunk, homes in (pinned) host memory,
/// payloads in `compute`, after a step that recorded the trace (chunk 0, then chunk 1).
fn two_chunks_recorded(params: &[Param], device: Device, budget: usize, compute: Kind) -> ChunkManager {
    let numel = params[0].tensor.numel();
    let cfg = ChunkConfig {
        device,
        budget,
        search: (numel, numel, 1),
        home_buffers: 2,
        compute,
        share_cpu_homes: false,
        trainable: true,
    };
    let mut m = ChunkManager::new(params, cfg, Tier::Host).unwrap();
    for c in 0..2 {
        m.access(&[c]).unwrap();
        m.done(&[c]).unwrap();
    }
    m.end_step();
    m.release_all().unwrap();
    m
}

/// Gemini claims its prefetch overlaps the copy of a chunk from its pinned host home with the
/// compute already running (`residency.rs`, a side stream). Checked with CUDA events rather
/// than assumed: the prefetch call returns without waiting for the copy, and copy plus compute
/// take clearly less than the copy alone (a load at the chunk's access, also timed here) plus
/// the compute alone. A pageable home, or a copy on the compute stream, would serialise them.
#[test]
fn gemini_prefetch_overlaps_the_copy_with_compute() {
    let Some((dev, _one_at_a_time)) = gpu() else { return };
    let device = Device::Cuda(dev);
    // Two parameters of 256 MiB.
    const NUMEL: usize = 64 << 20;
    let params = two_params(NUMEL);
    let expected: Vec<Tensor> = params.iter().map(|p| p.tensor.detach().copy()).collect();
    let mut m = two_chunks_recorded(&params, device, 2 * NUMEL * 4, Kind::Float);
    let x = Tensor::randn([4096, 4096], (Kind::Float, device));
    let compute = |n: usize| {
        for _ in 0..n {
            let _ = x.matmul(&x);
        }
    };

    // A replayed step without prefetch: chunk 1 loads at its access, on the compute stream.
    // Times the load, and three products to size the compute at three loads.
    m.access(&[0]).unwrap();
    m.done(&[0]).unwrap();
    compute(2);
    let (a, b, c) = (mark(dev), Event::new(true).unwrap(), Event::new(true).unwrap());
    compute(3);
    b.record(&Stream::current(dev).unwrap()).unwrap();
    m.access(&[1]).unwrap();
    c.record(&Stream::current(dev).unwrap()).unwrap();
    c.synchronize().unwrap();
    let (product_ms, load_ms) = (a.elapsed_ms(&b).unwrap() as f64 / 3.0, b.elapsed_ms(&c).unwrap() as f64);
    m.done(&[1]).unwrap();
    m.end_step();
    m.release_all().unwrap();
    let products = ((3.0 * load_ms / product_ms).ceil() as usize).max(1);
    let compute_ms = products as f64 * product_ms;

    // Replayed steps with prefetch: chunk 1 is fetched ahead while the products run. The
    // first warms the side stream and its staging memory; the second is measured.
    let (mut host_ms, mut total_ms) = (0.0, 0.0);
    for _ in 0..2 {
        m.access(&[0]).unwrap();
        m.done(&[0]).unwrap();
        cuda::synchronize(dev).unwrap();
        let start = mark(dev);
        let clock = std::time::Instant::now();
        m.prefetch(1).unwrap();
        host_ms = clock.elapsed().as_secs_f64() * 1e3;
        compute(products);
        m.access(&[1]).unwrap(); // The compute stream waits for the copy here.
        let end = mark(dev);
        end.synchronize().unwrap();
        total_ms = start.elapsed_ms(&end).unwrap() as f64;
        assert_eq!(m.events().last(), Some(&ChunkEvent::Prefetch(1)), "chunk 1 came by prefetch");
        for (p, e) in params.iter().zip(&expected) {
            assert!(p.tensor.to_device(Device::Cpu).equal(e), "{}: the prefetched values are the home's", p.name);
        }
        m.done(&[1]).unwrap();
        m.end_step();
        m.release_all().unwrap();
    }
    eprintln!(
        "gemini prefetch of 256 MiB: load alone {load_ms:.2} ms ({:.1} GB/s), compute alone {compute_ms:.2} ms, \
         both with prefetch {total_ms:.2} ms (serial would be {:.2} ms); prefetch call on the host {host_ms:.3} ms",
        (NUMEL * 4) as f64 / load_ms / 1e6,
        load_ms + compute_ms
    );
    assert!(host_ms < 0.5 * load_ms, "the prefetch call held the host {host_ms:.3} ms for a {load_ms:.2} ms copy");
    assert!(
        total_ms < load_ms + compute_ms - 0.5 * load_ms,
        "copy and compute did not overlap: {total_ms:.2} ms against {load_ms:.2} + {compute_ms:.2} ms one after the other"
    );
}

/// A bf16 payload prefetched from its fp32 host home stages the home on the device while the
/// side stream casts it, when the home's bf16 upload copy is stale (homes written outside the
/// optimizer: a checkpoint loaded, a shadow swapped in; a fresh upload copy crosses as it is and
/// stages nothing). A prefetch goes ahead only when payload and staged copy both fit the
/// budget; else it evicts nothing and the chunk loads at its access (converting on the host),
/// so the allocator's peak stays within the budget either way.
#[test]
fn gemini_prefetch_leaves_room_for_its_staged_copy() {
    let Some((dev, _one_at_a_time)) = gpu() else { return };
    let device = Device::Cuda(dev);
    // Two parameters: 32 MiB payloads in bf16, 64 MiB staged in fp32.
    const NUMEL: usize = 16 << 20;
    let (payload, staged) = (NUMEL * 2, NUMEL * 4);
    for (budget, prefetched) in [(2 * payload, false), (2 * payload + staged, true)] {
        // Fresh parameters for each manager: a manager makes them views into its payloads.
        let params = two_params(NUMEL);
        let expected: Vec<Tensor> = params.iter().map(|p| p.tensor.detach().to_kind(Kind::BFloat16)).collect();
        let mut m = two_chunks_recorded(&params, device, budget, Kind::BFloat16);
        assert_eq!(m.staging_bytes(), 0, "fresh upload copies cross as they are");
        m.homes_changed().unwrap();
        assert_eq!(m.staging_bytes(), staged);
        cuda::synchronize(dev).unwrap();
        let start = cuda::memory_stats(dev).unwrap().allocated;
        cuda::reset_peak_stats(dev).unwrap();
        m.access(&[0]).unwrap();
        m.done(&[0]).unwrap();
        let before = m.events().len();
        m.prefetch(1).unwrap();
        m.access(&[1]).unwrap();
        cuda::synchronize(dev).unwrap();
        let peak = cuda::memory_stats(dev).unwrap().peak_allocated - start;
        let want = if prefetched { ChunkEvent::Prefetch(1) } else { ChunkEvent::Load(1) };
        assert_eq!(m.events()[before..], [want], "budget {budget}: the step's events after chunk 0");
        assert!(peak as usize <= budget, "budget {budget}: the allocator peaked {peak} bytes above the step's start");
        for (p, e) in params.iter().zip(&expected) {
            assert!(p.tensor.to_device(Device::Cpu).equal(e), "{}: the loaded values are the home's", p.name);
        }
        m.done(&[1]).unwrap();
        m.end_step();
        m.release_all().unwrap();
    }
}

//! Where a job computes: the `--device` kind and the device it gives each rank.
use crate::cuda;

/// Where a job computes (`--device` of every binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// CUDA when a device is visible, else the CPU (the default).
    Auto,
    /// The CPU.
    Cpu,
    /// CUDA: each rank a GPU of its node.
    Cuda,
}

impl DeviceKind {
    /// `Auto` decided against the devices visible now; the others as they are.
    pub fn resolve(self) -> DeviceKind {
        match self {
            DeviceKind::Auto if cuda::is_available() => DeviceKind::Cuda,
            DeviceKind::Auto => DeviceKind::Cpu,
            kind => kind,
        }
    }

    /// The device of the rank with local index `local_rank` of the `local_ranks` on its node:
    /// under CUDA GPU `local_rank % device_count` (of those `CUDA_VISIBLE_DEVICES` shows), made
    /// this thread's current device before anything is allocated. NCCL needs a GPU per rank,
    /// so with more ranks on the node than GPUs `Auto` computes on the CPU and `Cuda` is an
    /// error, as it is without a GPU. The choice `Auto` made is said on stderr by local rank 0.
    pub fn device(self, local_rank: usize, local_ranks: usize) -> crate::Result<tch::Device> {
        let gpus = cuda::device_count();
        let crowded = local_ranks > gpus && gpus > 0;
        let resolved = match self.resolve() {
            DeviceKind::Cuda if self == DeviceKind::Auto && crowded => DeviceKind::Cpu,
            kind => kind,
        };
        if self == DeviceKind::Auto && local_rank == 0 {
            let why = match crowded {
                true => format!(", {local_ranks} ranks on this node: NCCL needs one per rank"),
                false => String::new(),
            };
            eprintln!("device: auto -> {resolved} ({gpus} CUDA device(s) visible{why})");
        }
        match resolved {
            DeviceKind::Cuda if gpus == 0 => {
                Err(crate::Error::CudaUnavailable("--device cuda, but libtorch sees no CUDA device".into()))
            }
            DeviceKind::Cuda if crowded => Err(crate::Error::invalid(format!(
                "--device cuda: {local_ranks} ranks on this node but {gpus} CUDA device(s) visible, and NCCL needs \
                 one GPU per rank (--nproc {gpus}, or --device cpu)"
            ))),
            DeviceKind::Cuda => {
                let d = local_rank % gpus;
                cuda::set_device(d)?;
                Ok(tch::Device::Cuda(d))
            }
            _ => Ok(tch::Device::Cpu),
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(DeviceKind::Auto),
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            other => Err(format!("unknown device {other:?} (expected auto, cpu or cuda)")),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Auto => "auto",
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_kinds_parse_and_print() {
        for kind in [DeviceKind::Auto, DeviceKind::Cpu, DeviceKind::Cuda] {
            assert_eq!(kind.to_string().parse::<DeviceKind>(), Ok(kind));
        }
        assert!("gpu".parse::<DeviceKind>().unwrap_err().contains("\"gpu\""));
    }

    #[test]
    fn auto_is_cuda_exactly_when_a_device_is_visible() {
        let expected = if cuda::is_available() { DeviceKind::Cuda } else { DeviceKind::Cpu };
        assert_eq!(DeviceKind::Auto.resolve(), expected);
        assert_eq!(DeviceKind::Cpu.resolve(), DeviceKind::Cpu);
        assert_eq!(DeviceKind::Cuda.resolve(), DeviceKind::Cuda);
        let device = DeviceKind::Auto.device(3, 4).unwrap();
        match cuda::device_count() {
            n if n >= 4 => assert_eq!(device, tch::Device::Cuda(3)),
            // Fewer GPUs than ranks (none included): NCCL could not run, so the CPU.
            _ => assert_eq!(device, tch::Device::Cpu),
        }
    }

    #[test]
    fn cuda_needs_a_gpu_for_every_rank_of_the_node() {
        let gpus = cuda::device_count();
        let err = DeviceKind::Cuda.device(0, gpus + 1).unwrap_err().to_string();
        let named = if gpus == 0 { "sees no CUDA device" } else { "NCCL needs one GPU per rank (--nproc" };
        assert!(err.contains(named), "{err}");
        assert_eq!(DeviceKind::Cpu.device(0, gpus + 1).unwrap(), tch::Device::Cpu);
    }
}

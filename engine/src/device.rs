//! Where a job computes: the `--device` kind and the device it gives each rank.
use crate::cuda;

/// Where a job computes (`--device` of every binary).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU.
    Cpu,
    /// CUDA: each rank its local GPU.
    Cuda,
}

impl DeviceKind {
    /// The device of the rank with local index `local_rank`; an error without a GPU.
    pub fn device(self, local_rank: usize) -> crate::Result<tch::Device> {
        match self {
            DeviceKind::Cpu => Ok(tch::Device::Cpu),
            DeviceKind::Cuda if cuda::is_available() => Ok(tch::Device::Cuda(local_rank)),
            DeviceKind::Cuda => {
                Err(crate::Error::CudaUnavailable("--device cuda, but libtorch sees no CUDA device".into()))
            }
        }
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            other => Err(format!("unknown device {other:?} (expected cpu or cuda)")),
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
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
        for kind in [DeviceKind::Cpu, DeviceKind::Cuda] {
            assert_eq!(kind.to_string().parse::<DeviceKind>(), Ok(kind));
        }
        assert!("gpu".parse::<DeviceKind>().unwrap_err().contains("\"gpu\""));
    }
}

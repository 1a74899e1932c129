//! Where an engine computes: `cpu` (the default) or `cuda[:N]`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// The compute device of an engine. Written `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    #[default]
    Cpu,
    /// The CUDA device of this ordinal.
    Cuda(usize),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a device: use cpu, cuda or cuda:N")]
pub struct ParseDeviceError(String);

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            t => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| ParseDeviceError(s.to_string())),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
        assert_eq!(Device::Cuda(0).to_string(), "cuda:0");
        assert_eq!(Device::default(), Device::Cpu);
    }

    #[test]
    fn serde_round_trip_as_a_string() {
        let j = serde_json::to_string(&Device::Cuda(1)).unwrap();
        assert_eq!(j, "\"cuda:1\"");
        assert_eq!(serde_json::from_str::<Device>(&j).unwrap(), Device::Cuda(1));
        assert!(serde_json::from_str::<Device>("\"tpu\"").is_err());
    }
}

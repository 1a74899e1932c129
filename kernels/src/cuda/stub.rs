//! Stands in for the device when the `cuda` feature is off.

use super::CudaError;

/// A CUDA device; without the `cuda` feature none can be opened.
#[derive(Debug)]
pub struct CudaDevice(());

impl CudaDevice {
    /// Always [`CudaError::NotBuilt`].
    pub fn open(_ordinal: usize) -> Result<CudaDevice, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Always [`CudaError::NotBuilt`].
    pub fn count() -> Result<usize, CudaError> {
        Err(CudaError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn stub_reports_unavailable() {
        assert!(!super::super::is_available());
        assert_eq!(
            super::CudaDevice::open(0).unwrap_err(),
            super::CudaError::NotBuilt
        );
    }
}

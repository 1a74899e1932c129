//! CUDA backend. It arrives in a later issue (cudarc with dynamic loading, NVRTC-compiled
//! sources under `kernels/cuda/`, behind the `cuda` feature); until then this stub stands in so
//! call sites need no `#[cfg]`.

/// Whether a CUDA device can be used. Always `false` until the backend lands.
pub fn is_available() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn stub_reports_unavailable() {
        assert!(!super::is_available());
    }
}

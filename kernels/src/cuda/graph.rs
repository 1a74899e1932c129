//! Capturing a sequence of ops on the compute stream into a CUDA graph, and replaying it:
//! one launch instead of one per kernel (a decode step of a 30-layer model is some 400
//! launches). What is captured must not allocate, copy from the host or synchronize; it
//! reads its inputs from device buffers the caller fills before each replay.

use super::device::{driver, CudaDevice};
use super::CudaError;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

/// A captured sequence of ops, replayed with [`CudaDevice::replay`].
pub struct DeviceGraph(CudaGraph);

// SAFETY: CUDA asks only that calls on one graph be serialised, not that they come from the
// thread that made it; a `DeviceGraph` is used through its owner, one call at a time (it is
// `Send`, not `Sync`).
unsafe impl Send for DeviceGraph {}

impl CudaDevice {
    /// Runs `ops` with the compute stream in capture mode and returns them as a graph; they
    /// do not execute now. An error from `ops` ends the capture and is returned.
    pub fn capture(
        &self,
        ops: impl FnOnce(&CudaDevice) -> Result<(), CudaError>,
    ) -> Result<DeviceGraph, CudaError> {
        // Thread-local: another thread's unrelated CUDA calls do not invalidate the capture.
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        let result = ops(self);
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        result?;
        match graph.map_err(driver)? {
            Some(g) => {
                g.upload().map_err(driver)?;
                Ok(DeviceGraph(g))
            }
            None => Err(CudaError::Driver("the capture recorded no work".into())),
        }
    }

    /// Queues `graph` on the compute stream.
    pub fn replay(&self, graph: &DeviceGraph) -> Result<(), CudaError> {
        graph.0.launch().map_err(driver)
    }
}

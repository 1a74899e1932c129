//! KV read out of the device on the copy stream, so the compute stream runs on meanwhile.
//!
//! The compute stream records a [`KvEvent`] once a layer's KV is written; a read of that
//! layer makes the copy stream wait on the event, pack the blocks into a device staging
//! buffer in the transfer layout and copy them into pinned host memory, and waits on the
//! copy stream alone. Pinned memory is what lets the copy run as DMA beside the compute
//! stream's kernels (a copy to pageable memory is staged by the driver and serialises).

use super::device::{driver, CudaDevice, KvGeometry};
use super::CudaError;
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};

/// A point in the compute stream's work (e.g. "layer 3's KV is written").
pub struct KvEvent(CudaEvent);

/// The copy stream's buffers for reading KV out: block ids, the packed blocks on the device
/// and their pinned host copy. Sized by [`reserve`](Self::reserve); reused across reads.
pub struct KvStager {
    ids: CudaSlice<i32>,
    packed: CudaSlice<u16>,
    pinned: PinnedHostSlice<u16>,
}

impl CudaDevice {
    /// An event, not yet recorded.
    pub fn kv_event(&self) -> Result<KvEvent, CudaError> {
        self.ctx.new_event(None).map(KvEvent).map_err(driver)
    }

    /// Records everything queued on the compute stream so far into `event`.
    pub fn record(&self, event: &KvEvent) -> Result<(), CudaError> {
        event.0.record(&self.stream).map_err(driver)
    }

    /// A stager that holds reads of up to `blocks` blocks of `halves_per_block` f16 each (K
    /// and V together).
    pub fn kv_stager(&self, blocks: usize, halves_per_block: usize) -> Result<KvStager, CudaError> {
        let halves = (blocks * halves_per_block).max(1);
        Ok(KvStager {
            ids: self.copy.alloc_zeros(blocks.max(1)).map_err(driver)?,
            packed: self.copy.alloc_zeros(halves).map_err(driver)?,
            // SAFETY: written by the device before the host reads it (see `read_kv`).
            // Default flags: write-combined memory is slow for the host to read back.
            pinned: unsafe { self.ctx.alloc_pinned_with_flags(halves, 0) }.map_err(driver)?,
        })
    }

    /// Appends `blocks` of one layer's `k_cache`/`v_cache` to `out` in the transfer layout,
    /// on the copy stream once `after` has passed on the compute stream. Waits for the copy,
    /// not for the compute stream. Block ids must be valid (checked by the caller).
    #[allow(clippy::too_many_arguments)]
    pub fn read_kv(
        &self,
        stager: &mut KvStager,
        after: &KvEvent,
        g: &KvGeometry,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        blocks: &[i32],
        out: &mut Vec<u8>,
    ) -> Result<(), CudaError> {
        let n = blocks.len();
        if n == 0 {
            return Ok(());
        }
        let halves = 2 * n * g.block_elems();
        if stager.ids.len() < n || stager.packed.len() < halves || stager.pinned.len() < halves {
            return Err(CudaError::Shape(format!(
                "read_kv: {n} blocks ({halves} halves) exceed the stager's {} blocks ({} halves)",
                stager.ids.len(),
                stager.packed.len().min(stager.pinned.len())
            )));
        }
        self.copy.wait(&after.0).map_err(driver)?;
        self.copy
            .memcpy_htod(blocks, &mut stager.ids.slice_mut(..n))
            .map_err(driver)?;
        self.kv_pack_on(
            &self.copy,
            g,
            k_cache,
            v_cache,
            &stager.ids.slice(..n),
            n,
            &mut stager.packed.slice_mut(..halves),
        )?;
        self.copy
            .memcpy_dtoh(&stager.packed.slice(..halves), &mut stager.pinned)
            .map_err(driver)?;
        self.copy.synchronize().map_err(driver)?;
        let host = stager.pinned.as_slice().map_err(driver)?;
        out.extend_from_slice(bytemuck::cast_slice(&host[..halves]));
        Ok(())
    }
}

impl KvStager {
    /// Blocks a read may hold.
    pub fn capacity_blocks(&self) -> usize {
        self.ids.len()
    }
}

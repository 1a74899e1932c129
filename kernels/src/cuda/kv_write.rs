//! KV arriving in the transfer layout, written into the device's cache: each piece (a run of
//! one layer's blocks) is copied by the host into one of two pinned buffers, copied from there
//! to the device by DMA and scattered into the cache by `kv_unpack`, all queued on the compute
//! stream. The host fills one pinned buffer while the other's copy runs, and waits only for
//! the copy that last read the buffer it is about to fill. No per-element work on the host,
//! no allocation per write: the buffers are kept and grown.

use super::device::{driver, CudaDevice, KvGeometry};
use super::CudaError;
use cudarc::driver::{result, CudaEvent, CudaSlice, DevicePtrMut, PinnedHostSlice};
use std::ops::Range;

/// The buffers of [`CudaDevice::write_kv_piece`]: two pinned host buffers and two device
/// buffers of `piece_bytes` each, and the block ids of the current write.
pub struct KvUnstager {
    pinned: [PinnedHostSlice<u8>; 2],
    dev: [CudaSlice<u16>; 2],
    /// Recorded on the compute stream after each pinned buffer's copy to the device.
    copied: [CudaEvent; 2],
    ids: CudaSlice<i32>,
    /// The buffer the next piece goes through.
    next: usize,
}

impl KvUnstager {
    /// Bytes a piece may hold.
    pub fn piece_bytes(&self) -> usize {
        self.pinned[0].len()
    }

    /// Block ids a write may name.
    pub fn capacity_blocks(&self) -> usize {
        self.ids.len()
    }
}

impl Drop for KvUnstager {
    /// A copy still reading a pinned buffer must end before the buffer is freed.
    fn drop(&mut self) {
        for e in &self.copied {
            let _ = e.synchronize();
        }
    }
}

impl CudaDevice {
    /// An unstager for pieces of up to `piece_bytes` bytes (an even number) and writes of up
    /// to `blocks` blocks.
    pub fn kv_unstager(&self, piece_bytes: usize, blocks: usize) -> Result<KvUnstager, CudaError> {
        let bytes = piece_bytes.max(2);
        let pinned = || {
            // SAFETY: only written by the host (write_kv_piece) before a copy reads it.
            // Default flags: the host writes it with plain stores.
            unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes, 0) }.map_err(driver)
        };
        Ok(KvUnstager {
            pinned: [pinned()?, pinned()?],
            dev: [self.zeros(bytes / 2)?, self.zeros(bytes / 2)?],
            copied: [
                self.ctx.new_event(None).map_err(driver)?,
                self.ctx.new_event(None).map_err(driver)?,
            ],
            ids: self.zeros(blocks.max(1))?,
            next: 0,
        })
    }

    /// Starts a write of `blocks` (cache block ids, valid: checked by the caller): queues
    /// their upload on the compute stream.
    pub fn write_kv_ids(&self, st: &mut KvUnstager, blocks: &[i32]) -> Result<(), CudaError> {
        if blocks.len() > st.ids.len() {
            return Err(CudaError::Shape(format!(
                "write_kv_ids: {} blocks, the unstager holds {}",
                blocks.len(),
                st.ids.len()
            )));
        }
        self.copy_in(blocks, &mut st.ids.slice_mut(..))
    }

    /// Writes `bytes`, the transfer layout of the blocks `ids` (indices into the ids of
    /// [`write_kv_ids`](Self::write_kv_ids)) of one layer, into that layer's cache. Queued on
    /// the compute stream; returns once `bytes` is copied into pinned memory, so the caller
    /// may reuse it. Everything queued ends by the stream's next synchronization.
    pub fn write_kv_piece(
        &self,
        st: &mut KvUnstager,
        g: &KvGeometry,
        bytes: &[u8],
        ids: Range<usize>,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let need = 4 * g.block_elems() * ids.len();
        if bytes.len() != need || need > st.piece_bytes() || ids.end > st.ids.len() {
            return Err(CudaError::Shape(format!(
                "write_kv_piece: {} bytes for {} blocks ({need} expected, pieces of {}, ids {:?} \
                 of {})",
                bytes.len(),
                ids.len(),
                st.piece_bytes(),
                ids,
                st.ids.len()
            )));
        }
        let b = st.next;
        st.next ^= 1;
        // The copy that last read this buffer (two pieces ago) must be done.
        st.copied[b].synchronize().map_err(driver)?;
        let host = &mut st.pinned[b].as_mut_slice().map_err(driver)?[..need];
        host.copy_from_slice(bytes);
        {
            let (dst, _record) = st.dev[b].device_ptr_mut(&self.stream);
            // SAFETY: `host` is pinned and stays untouched until `copied[b]` has passed (it is
            // only written above, after waiting on it; the unstager waits on it when dropped);
            // `dev[b]` holds piece_bytes >= need bytes.
            unsafe { result::memcpy_htod_async(dst, host, self.stream.cu_stream()) }
                .map_err(driver)?;
        }
        st.copied[b].record(&self.stream).map_err(driver)?;
        let n = ids.len();
        let payload = st.dev[b].slice(..need / 2);
        let ids = st.ids.slice(ids);
        self.kv_unpack(g, &payload, &ids, n, k_cache, v_cache)
    }
}

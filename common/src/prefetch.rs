//! A hint to start loading memory that will be read soon. Tables of millions of entries (a
//! node's prefix cache, the cluster's prefix index) miss the cache on most probes; hinting a
//! batch's entries first overlaps those misses instead of taking them one after another.

/// Starts loading the cache line holding `value`. Only a hint: it changes no state the
/// program can observe, and does nothing on targets without such an instruction.
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults and writes nothing; the address is a live reference.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

//! A CUDA device with the kernels loaded, and the ops of the forward pass on device buffers.
//!
//! Every op checks its buffers' lengths against the shapes it is given before launching (an
//! out-of-bounds write on a GPU corrupts memory silently), and returns a [`CudaError`] instead.
//! All work is queued on one stream in order; reads back to the host synchronize.

use super::layout::{
    act_layout, attention_threads, dp4a_launch, quantize_blocks, split_blocks, split_layout,
    GemvKernel, DP4A_THREADS, GEMV_MAX_M, QUANTIZE_THREADS,
};
use super::nvrtc::cached_ptx;
use super::source::{format_code, SOURCES};
use super::CudaError;
use crate::{QMatrix, WeightFormat};
use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, DriverError, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::Arc;

pub(super) fn driver(e: DriverError) -> CudaError {
    CudaError::Driver(format!("{e:?}"))
}

fn shape(msg: String) -> CudaError {
    CudaError::Shape(msg)
}

fn check_len(what: &str, len: usize, need: usize) -> Result<(), CudaError> {
    if len < need {
        return Err(shape(format!("{what}: {len} elements, {need} needed")));
    }
    Ok(())
}

fn i32_of(what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(format!("{what} = {v} does not fit a kernel's int")))
}

/// `n` threads in blocks of `threads`.
fn grid(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(threads as usize).max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Warps (output rows) per reference GEMV block (`GEMV_WARPS` in quant.cu).
const GEMV_WARPS: usize = 4;
/// Head dims the attention kernel handles: a multiple of 32, at most 256 (`ATTN_MAX_DPL`).
const ATTN_MAX_HEAD_DIM: usize = 256;
/// Head dims the tiled prefill attention handles (`TILE_MAX_HD`); larger ones go row by row.
pub const ATTN_TILED_MAX_HEAD_DIM: usize = 128;
/// Threads of the tiled prefill attention (`TILE_WARPS` warps).
const ATTN_TILED_THREADS: u32 = 128;
const SAMPLE_THREADS: u32 = 1024;

/// A weight matrix on the device: its ggml bytes as stored (read by the reference GEMV and
/// the embedding gather), for Q4_1/Q8_0 on a device whose GEMV is [`GemvKernel::Dp4a`] the
/// same bits in the split layout (`layout.rs`) that kernel reads, and a bf16 copy dequantized
/// once at upload for cuBLAS.
pub struct DeviceQMatrix {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    raw: CudaSlice<u8>,
    /// The split copy and where its scales start.
    split: Option<(CudaSlice<u8>, usize)>,
    dense: CudaSlice<u16>,
}

/// cuBLAS's workspace, given to it once so it never allocates inside a step: a step captured
/// into a CUDA graph must not allocate. 32 MiB is what NVIDIA advises for Hopper.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A CUDA device: context, the compute stream and the copy stream (KV read out for the
/// transport while the compute stream runs on, see `copy_stream`), the compiled kernels and
/// a cuBLAS handle.
pub struct CudaDevice {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
    blas: CudaBlas,
    /// Owned here for as long as `blas` uses it.
    _blas_workspace: CudaSlice<u8>,
    funcs: HashMap<&'static str, CudaFunction>,
    name: String,
    capability: (i32, i32),
    /// The kernel decode's matmuls take; matrices uploaded under `Dp4a` carry its layout.
    gemv: GemvKernel,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("capability", &self.capability)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Devices the driver sees; [`CudaError::NoDriver`] when libcuda does not load.
    pub fn count() -> Result<usize, CudaError> {
        // SAFETY: only tries to dlopen the driver's library names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        cudarc::driver::result::init().map_err(driver)?;
        let n = CudaContext::device_count().map_err(driver)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Opens device `ordinal` and loads every kernel, compiled for its architecture (from the
    /// kernel cache, or with NVRTC).
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        // Work goes to the compute stream in order; the copy stream only reads KV, after an
        // explicit event (`copy_stream`). cudarc's per-buffer events (recorded at every
        // launch) would only add latency to each op, and cannot be recorded inside a graph
        // capture.
        // SAFETY: every buffer is used on the compute stream, except the KV the copy stream
        // reads once the compute stream's event says it is written, and the copy stream's
        // own staging buffers.
        unsafe { ctx.disable_event_tracking() };
        let capability = ctx.compute_capability().map_err(driver)?;
        let name = ctx.name().map_err(driver)?;
        let arch = format!("compute_{}{}", capability.0, capability.1);
        let stream = ctx.new_stream().map_err(driver)?;
        let copy = ctx.new_stream().map_err(driver)?;
        let mut funcs = HashMap::new();
        for s in SOURCES {
            let ptx = cached_ptx(s, &arch)?;
            let module = ctx.load_module(Ptx::from_src(ptx)).map_err(driver)?;
            for &k in s.kernels {
                funcs.insert(k, module.load_function(k).map_err(driver)?);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        let mut workspace = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
            .map_err(driver)?;
        {
            let (ptr, _record) = workspace.device_ptr_mut(&stream);
            // SAFETY: the workspace outlives the handle (both are fields of the device, the
            // handle declared first, so dropped first) and is used on the handle's stream.
            unsafe {
                blas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, BLAS_WORKSPACE_BYTES)
            }
            .result()
            .map_err(|e| CudaError::Blas(format!("{e:?}")))?;
        }
        Ok(CudaDevice {
            ctx,
            stream,
            copy,
            blas,
            _blas_workspace: workspace,
            funcs,
            name,
            capability,
            gemv: GemvKernel::default(),
        })
    }

    /// Chooses the kernel of decode's matmuls ([`GemvKernel::Dp4a`] unless set). The int8
    /// GEMV reads a copy of the weights made at upload: a matrix uploaded while `Reference`
    /// was chosen has none, and `matmul` refuses it under `Dp4a`.
    pub fn set_gemv(&mut self, kernel: GemvKernel) {
        self.gemv = kernel;
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor) compute capability.
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(driver)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver)
    }

    pub(super) fn f(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.funcs
            .get(name)
            .ok_or_else(|| CudaError::Driver(format!("kernel {name} is not loaded")))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(host).map_err(driver)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros(n.max(1)).map_err(driver)
    }

    /// Copies `dev` into `host` (which sets the length) and waits for it.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaView<'_, T>,
        host: &mut Vec<T>,
    ) -> Result<(), CudaError> {
        host.clear();
        host.resize(dev.len(), T::default());
        self.stream.memcpy_dtoh(dev, host).map_err(driver)?;
        self.synchronize()
    }

    /// Copies `host` into the start of `dev`.
    pub fn copy_in<T: DeviceRepr>(
        &self,
        host: &[T],
        dev: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        check_len("copy_in", dev.len(), host.len())?;
        let mut head = dev.slice_mut(..host.len());
        self.stream.memcpy_htod(host, &mut head).map_err(driver)
    }

    /// Copies `src` into the start of `dst` on the device.
    pub fn copy_within<T: DeviceRepr>(
        &self,
        src: &CudaView<'_, T>,
        dst: &mut CudaViewMut<'_, T>,
    ) -> Result<(), CudaError> {
        check_len("copy_within", dst.len(), src.len())?;
        let mut head = dst.slice_mut(..src.len());
        self.stream.memcpy_dtod(src, &mut head).map_err(driver)
    }

    /// Uploads a weight matrix: its ggml bytes (K-quants, which no kernel reads, as f32), for
    /// the int8 GEMV the same bytes split (Q4_1/Q8_0, when it is the chosen GEMV), and a bf16
    /// copy for cuBLAS, dequantized on the device.
    pub fn upload_matrix(&self, w: &QMatrix) -> Result<DeviceQMatrix, CudaError> {
        let (format, bytes) = match format_code(w.format) {
            Some(_) => (w.format, w.data().to_vec()),
            None => {
                let mut out = vec![0f32; w.rows * w.cols];
                for (r, row) in out.chunks_exact_mut(w.cols.max(1)).enumerate() {
                    w.dequantize_row(r, row);
                }
                (WeightFormat::F32, bytemuck::cast_slice(&out).to_vec())
            }
        };
        let row_bytes = format
            .row_bytes(w.cols)
            .map_err(|e| shape(format!("upload_matrix: {e}")))?;
        let split = match self.gemv {
            GemvKernel::Dp4a => split_blocks(format, &bytes),
            GemvKernel::Reference => None,
        };
        let split = match (split, split_layout(format, w.rows * w.cols / 32)) {
            (Some(s), Some(l)) => Some((self.upload(&s)?, l.quant_bytes)),
            _ => None,
        };
        let raw = self.upload(&bytes)?;
        let mut dense = self.zeros::<u16>(w.rows * w.cols)?;
        let n = w.rows * w.cols;
        if n > 0 {
            let (rows, cols) = (i32_of("rows", w.rows)?, i32_of("cols", w.cols)?);
            let (rb, fmt) = (row_bytes as i64, format_code(format).unwrap_or(0));
            let mut b = self.stream.launch_builder(self.f("dequant_bf16")?);
            b.arg(&raw).arg(&mut dense).arg(&rows).arg(&cols);
            b.arg(&rb).arg(&fmt);
            // SAFETY: `raw` holds rows * row_bytes bytes and `dense` rows * cols halves.
            unsafe { b.launch(grid(n, 256)) }.map_err(driver)?;
        }
        Ok(DeviceQMatrix {
            format,
            rows: w.rows,
            cols: w.cols,
            row_bytes,
            raw,
            split,
            dense,
        })
    }

    /// `out[m, w.rows] = x[m, w.cols] · wᵀ`. Q8_0/Q4_1 weights with `m` up to 8 take a GEMV
    /// (the weights read once, as uploaded: decode): the int8 one quantizes `x` into `scratch`
    /// first, the reference one reads `x` as it is. Everything else rounds `x` to bf16 into
    /// `scratch` and runs a cuBLAS GEMM on the bf16 weights with f32 accumulation (prefill).
    /// `scratch` holds `m * w.cols` halves.
    pub fn matmul(
        &self,
        w: &DeviceQMatrix,
        x: &CudaView<'_, f32>,
        m: usize,
        out: &mut CudaViewMut<'_, f32>,
        scratch: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        check_len("matmul x", x.len(), m * w.cols)?;
        check_len("matmul out", out.len(), m * w.rows)?;
        if m == 0 || w.rows == 0 {
            return Ok(());
        }
        let (rows, cols) = (i32_of("rows", w.rows)?, i32_of("cols", w.cols)?);
        let gemv = matches!(w.format, WeightFormat::Q8_0 | WeightFormat::Q4_1) && m <= GEMV_MAX_M;
        if gemv && self.gemv == GemvKernel::Dp4a {
            return self.gemv_dp4a(w, x, m, out, scratch);
        }
        let reference = match w.format {
            WeightFormat::Q8_0 if gemv => Some("gemv_q8_0"),
            WeightFormat::Q4_1 if gemv => Some("gemv_q4_1"),
            _ => None,
        };
        if let Some(name) = reference {
            let mi = m as i32;
            let mut b = self.stream.launch_builder(self.f(name)?);
            b.arg(&w.raw).arg(x).arg(out).arg(&rows).arg(&cols).arg(&mi);
            let cfg = LaunchConfig {
                grid_dim: (w.rows.div_ceil(GEMV_WARPS) as u32, 1, 1),
                block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: lengths checked above; the kernel reads rows * row_bytes weight bytes.
            return unsafe { b.launch(cfg) }.map(drop).map_err(driver);
        }
        check_len("matmul scratch", scratch.len(), m * w.cols)?;
        let n = (m * w.cols) as i64;
        let mut b = self.stream.launch_builder(self.f("f32_to_bf16")?);
        b.arg(x).arg(&mut *scratch).arg(&n);
        // SAFETY: both buffers hold at least m * cols elements.
        unsafe { b.launch(grid(m * w.cols, 256)) }.map_err(driver)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mi = i32_of("m", m)?;
        let (a, _ra) = w.dense.device_ptr(&self.stream);
        let (bx, _rb) = scratch.device_ptr(&self.stream);
        let (c, _rc) = out.device_ptr_mut(&self.stream);
        // cuBLAS is column-major: row-major out[m, rows] is C = [rows, m]; the row-major
        // weights read as column-major are [cols, rows], transposed to A = [rows, cols]; the
        // activations are B = [cols, m].
        // SAFETY: A holds rows * cols, B m * cols, C m * rows elements (checked above).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                rows,
                mi,
                cols,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                cols,
                bx as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                cols,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                rows,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::Blas(format!("{e:?}")))
    }

    /// The int8 GEMV (gemv.cu): `x` quantized per block of 32 into `scratch` (the int8 values,
    /// then a `(d, s)` pair per block: `layout::act_layout`), then the dot products over the
    /// split weights.
    fn gemv_dp4a(
        &self,
        w: &DeviceQMatrix,
        x: &CudaView<'_, f32>,
        m: usize,
        out: &mut CudaViewMut<'_, f32>,
        scratch: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let Some((split, scales_at)) = &w.split else {
            return Err(shape(
                "matmul: the int8 GEMV was chosen after this matrix was uploaded without its \
                 split copy"
                    .into(),
            ));
        };
        let launch = dp4a_launch(w.format, w.rows, m)
            .ok_or_else(|| shape(format!("matmul: no int8 GEMV for {:?}", w.format)))?;
        let act = act_layout(m, w.cols);
        // Halves of scratch, from bytes (both offsets are even: cols is a multiple of 32).
        check_len("matmul scratch", scratch.len(), act.bytes.div_ceil(2))?;
        let ds_at = act.ds_offset / 2;
        let nb = w.cols / 32;
        let (blocks, nbi, mi) = (i32_of("blocks", m * nb)?, i32_of("nb", nb)?, m as i32);
        let rows = i32_of("rows", w.rows)?;
        {
            let (mut xq, mut ds) = scratch.split_at_mut(ds_at);
            let mut b = self.stream.launch_builder(self.f("quantize_q8_1")?);
            b.arg(x).arg(&mut xq).arg(&mut ds).arg(&blocks);
            let cfg = LaunchConfig {
                grid_dim: (quantize_blocks(m, w.cols) as u32, 1, 1),
                block_dim: (QUANTIZE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x holds m * cols floats; scratch m * cols int8 then m * nb (d, s) pairs
            // (checked above).
            unsafe { b.launch(cfg) }.map_err(driver)?;
        }
        let (xq, ds) = (scratch.slice(..ds_at), scratch.slice(ds_at..));
        let (quants, scales) = (split.slice(..*scales_at), split.slice(*scales_at..));
        let mut b = self.stream.launch_builder(self.f(launch.kernel)?);
        b.arg(&quants)
            .arg(&scales)
            .arg(&xq)
            .arg(&ds)
            .arg(out)
            .arg(&rows)
            .arg(&nbi)
            .arg(&mi);
        let cfg = LaunchConfig {
            grid_dim: (launch.blocks, 1, 1),
            block_dim: (DP4A_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the split copy holds rows * nb blocks' quants and scales, the scratch the
        // quantized m rows, out m * rows floats (checked in `matmul`).
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }

    /// `out = x / sqrt(mean(x²) + eps) * w` for `rows` rows of `w.len()`.
    pub fn rmsnorm(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let d = w.len();
        check_len("rmsnorm x", x.len(), rows * d)?;
        check_len("rmsnorm out", out.len(), rows * d)?;
        if rows == 0 {
            return Ok(());
        }
        let di = i32_of("d", d)?;
        let mut b = self.stream.launch_builder(self.f("rmsnorm_f32")?);
        b.arg(x).arg(w).arg(out).arg(&di).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }

    /// `x[..n] += y[..n]`.
    pub fn add(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        y: &CudaView<'_, f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        check_len("add x", x.len(), n)?;
        check_len("add y", y.len(), n)?;
        let ni = n as i64;
        let mut b = self.stream.launch_builder(self.f("add_f32")?);
        b.arg(x).arg(y).arg(&ni);
        // SAFETY: lengths checked above.
        unsafe { b.launch(grid(n, 256)) }.map(drop).map_err(driver)
    }

    /// `x[r, :] += bias` for `rows` rows of `bias.len()`.
    pub fn add_rows(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let n = rows * bias.len();
        check_len("add_rows x", x.len(), n)?;
        let (ni, cols) = (n as i64, i32_of("cols", bias.len())?);
        let mut b = self.stream.launch_builder(self.f("add_rows_f32")?);
        b.arg(x).arg(bias).arg(&ni).arg(&cols);
        // SAFETY: lengths checked above.
        unsafe { b.launch(grid(n, 256)) }.map(drop).map_err(driver)
    }

    /// `out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]` for `n` rows.
    pub fn silu_mul(
        &self,
        gate_up: &CudaView<'_, f32>,
        inter: usize,
        n: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        check_len("silu_mul gate_up", gate_up.len(), n * 2 * inter)?;
        check_len("silu_mul out", out.len(), n * inter)?;
        let (total, ii) = ((n * inter) as i64, i32_of("inter", inter)?);
        let mut b = self.stream.launch_builder(self.f("silu_mul_f32")?);
        b.arg(gate_up).arg(out).arg(&total).arg(&ii);
        // SAFETY: lengths checked above.
        unsafe { b.launch(grid(n * inter, 256)) }
            .map(drop)
            .map_err(driver)
    }

    /// `out[t, :]` = row `tokens[t]` of `table`, dequantized, for `n` tokens. Token ids must
    /// be below `table.rows` (the caller validates them; the kernel does not).
    pub fn embed(
        &self,
        table: &DeviceQMatrix,
        tokens: &CudaView<'_, i32>,
        n: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        check_len("embed tokens", tokens.len(), n)?;
        check_len("embed out", out.len(), n * table.cols)?;
        if n == 0 {
            return Ok(());
        }
        let cols = i32_of("cols", table.cols)?;
        let rb = table.row_bytes as i64;
        let fmt = format_code(table.format).unwrap_or(0);
        let mut b = self.stream.launch_builder(self.f("embed_rows")?);
        b.arg(&table.raw)
            .arg(tokens)
            .arg(out)
            .arg(&cols)
            .arg(&rb)
            .arg(&fmt);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; token ids validated by the caller.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }

    /// RoPE in place on heads `0..n_heads` of `n_rows` rows of `x`, `row_stride` apart; row `t`
    /// at `positions[t]` (see `cpu::rope`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        positions: &CudaView<'_, i32>,
        n_rows: usize,
        row_stride: usize,
        n_heads: usize,
        head_dim: usize,
        base: f32,
        interleaved: bool,
    ) -> Result<(), CudaError> {
        if !head_dim.is_multiple_of(2) {
            return Err(shape(format!("rope: odd head_dim {head_dim}")));
        }
        check_len("rope positions", positions.len(), n_rows)?;
        if n_rows > 0 {
            check_len(
                "rope x",
                x.len(),
                (n_rows - 1) * row_stride + n_heads * head_dim,
            )?;
        }
        let total = n_rows * n_heads * head_dim / 2;
        if total == 0 {
            return Ok(());
        }
        let (nr, stride) = (i32_of("rows", n_rows)?, row_stride as i64);
        let (nh, hd, il) = (
            i32_of("heads", n_heads)?,
            i32_of("head_dim", head_dim)?,
            i32::from(interleaved),
        );
        let mut b = self.stream.launch_builder(self.f("rope_f32")?);
        b.arg(x).arg(positions).arg(&nr).arg(&stride);
        b.arg(&nh).arg(&hd).arg(&base).arg(&il);
        // SAFETY: lengths checked above.
        unsafe { b.launch(grid(total, 256)) }
            .map(drop)
            .map_err(driver)
    }
}

/// The device side of one layer's KV cache and the geometry the KV kernels share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

impl KvGeometry {
    /// Halves of K (or V) in one block of one layer.
    pub fn block_elems(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim
    }

    pub(super) fn layer_elems(&self) -> usize {
        self.block_elems() * self.num_blocks
    }
}

impl CudaDevice {
    /// Writes K and V rows of `n` tokens (`stride` apart, starting at `k` and `v`) into the
    /// cache slots `slots[t]` (physical block * block_size + offset), rounding to f16.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &self,
        g: &KvGeometry,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        stride: usize,
        slots: &CudaView<'_, i32>,
        n: usize,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let row = g.n_kv_heads * g.head_dim;
        if n == 0 {
            return Ok(());
        }
        check_len("kv_append k", k.len(), (n - 1) * stride + row)?;
        check_len("kv_append v", v.len(), (n - 1) * stride + row)?;
        check_len("kv_append slots", slots.len(), n)?;
        check_len("kv_append k_cache", k_cache.len(), g.layer_elems())?;
        check_len("kv_append v_cache", v_cache.len(), g.layer_elems())?;
        let (st, ni) = (stride as i64, i32_of("n", n)?);
        let (nkv, hd, bs) = (
            i32_of("n_kv_heads", g.n_kv_heads)?,
            i32_of("head_dim", g.head_dim)?,
            i32_of("block_size", g.block_size)?,
        );
        let mut b = self.stream.launch_builder(self.f("kv_append")?);
        b.arg(k)
            .arg(v)
            .arg(&st)
            .arg(k_cache)
            .arg(v_cache)
            .arg(slots);
        b.arg(&ni).arg(&nkv).arg(&hd).arg(&bs);
        // SAFETY: lengths checked above; slots are validated by the caller.
        unsafe { b.launch(grid(n * row, 256)) }
            .map(drop)
            .map_err(driver)
    }

    /// Paged causal attention for `n_rows` query rows: row `r`'s q at `r * q_stride` of `q`,
    /// at position `row_pos[r]`, through the block table at `tables[row_table[r]..]`; output
    /// rows `out_stride` apart. With `tiles` ([`attention_tiles`](super::attention_tiles) of
    /// the step's sequences, and how many), rows are computed a tile at a time where head dims
    /// allow (at most [`ATTN_TILED_MAX_HEAD_DIM`]). See attention.cu.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        g: &KvGeometry,
        q: &CudaView<'_, f32>,
        q_stride: usize,
        row_pos: &CudaView<'_, i32>,
        row_table: &CudaView<'_, i32>,
        tables: &CudaView<'_, i32>,
        tiles: Option<(&CudaView<'_, i32>, usize)>,
        n_rows: usize,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        out: &mut CudaViewMut<'_, f32>,
        out_stride: usize,
    ) -> Result<(), CudaError> {
        if !g.head_dim.is_multiple_of(32) || g.head_dim > ATTN_MAX_HEAD_DIM {
            return Err(shape(format!(
                "attention: head_dim {} is not a multiple of 32 up to {ATTN_MAX_HEAD_DIM}",
                g.head_dim
            )));
        }
        if g.n_kv_heads == 0 || !g.n_heads.is_multiple_of(g.n_kv_heads) {
            return Err(shape("attention: n_heads % n_kv_heads != 0".into()));
        }
        if n_rows == 0 {
            return Ok(());
        }
        let q_row = g.n_heads * g.head_dim;
        check_len("attention q", q.len(), (n_rows - 1) * q_stride + q_row)?;
        check_len(
            "attention out",
            out.len(),
            (n_rows - 1) * out_stride + q_row,
        )?;
        check_len("attention row_pos", row_pos.len(), n_rows)?;
        check_len("attention row_table", row_table.len(), n_rows)?;
        check_len("attention k_cache", k_cache.len(), g.layer_elems())?;
        check_len("attention v_cache", v_cache.len(), g.layer_elems())?;
        let (qs, os) = (q_stride as i64, out_stride as i64);
        let (nh, nkv, hd, bs) = (
            i32_of("n_heads", g.n_heads)?,
            i32_of("n_kv_heads", g.n_kv_heads)?,
            i32_of("head_dim", g.head_dim)?,
            i32_of("block_size", g.block_size)?,
        );
        let scale = 1.0f32 / (g.head_dim as f32).sqrt();
        let tiles = tiles.filter(|_| g.head_dim <= ATTN_TILED_MAX_HEAD_DIM);
        if let Some((t, n_tiles)) = tiles {
            check_len("attention tiles", t.len(), n_tiles + 1)?;
        }
        let kernel = match tiles {
            Some(_) => "paged_attention_tiled",
            None => "paged_attention",
        };
        let mut b = self.stream.launch_builder(self.f(kernel)?);
        b.arg(q)
            .arg(&qs)
            .arg(out)
            .arg(&os)
            .arg(k_cache)
            .arg(v_cache);
        b.arg(row_pos).arg(row_table).arg(tables);
        if let Some((t, _)) = tiles {
            b.arg(t);
        }
        b.arg(&nh).arg(&nkv).arg(&hd).arg(&bs).arg(&scale);
        let blocks = tiles.map_or(n_rows, |(_, n_tiles)| n_tiles);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, g.n_heads as u32, 1),
            block_dim: match tiles {
                Some(_) => (ATTN_TILED_THREADS, 1, 1),
                None => (attention_threads(n_rows, g.n_heads), 1, 1),
            },
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; positions, block tables and tiles (each within the
        // rows, of one sequence) validated by the caller.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }

    /// Packs `blocks` of one layer into `out` in the transfer layout (K then V per block).
    pub fn kv_pack(
        &self,
        g: &KvGeometry,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        blocks: &CudaView<'_, i32>,
        n_blocks: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), CudaError> {
        self.kv_pack_on(&self.stream, g, k_cache, v_cache, blocks, n_blocks, out)
    }

    /// [`kv_pack`](Self::kv_pack) queued on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kv_pack_on(
        &self,
        stream: &Arc<CudaStream>,
        g: &KvGeometry,
        k_cache: &CudaSlice<u16>,
        v_cache: &CudaSlice<u16>,
        blocks: &CudaView<'_, i32>,
        n_blocks: usize,
        out: &mut CudaViewMut<'_, u16>,
    ) -> Result<(), CudaError> {
        let be = g.block_elems();
        check_len("kv_pack blocks", blocks.len(), n_blocks)?;
        check_len("kv_pack out", out.len(), 2 * n_blocks * be)?;
        check_len("kv_pack k_cache", k_cache.len(), g.layer_elems())?;
        check_len("kv_pack v_cache", v_cache.len(), g.layer_elems())?;
        if n_blocks == 0 {
            return Ok(());
        }
        let (nb, words) = (i32_of("n_blocks", n_blocks)?, (be / 2) as i64);
        let mut b = stream.launch_builder(self.f("kv_pack")?);
        b.arg(k_cache)
            .arg(v_cache)
            .arg(blocks)
            .arg(&nb)
            .arg(&words)
            .arg(out);
        // SAFETY: lengths checked above (block_elems is even: head_dim is); block ids are
        // validated by the caller.
        unsafe { b.launch(grid(n_blocks * be / 2, 256)) }
            .map(drop)
            .map_err(driver)
    }

    /// The inverse of [`kv_pack`](Self::kv_pack).
    pub fn kv_unpack(
        &self,
        g: &KvGeometry,
        payload: &CudaView<'_, u16>,
        blocks: &CudaView<'_, i32>,
        n_blocks: usize,
        k_cache: &mut CudaSlice<u16>,
        v_cache: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        let be = g.block_elems();
        check_len("kv_unpack blocks", blocks.len(), n_blocks)?;
        check_len("kv_unpack payload", payload.len(), 2 * n_blocks * be)?;
        check_len("kv_unpack k_cache", k_cache.len(), g.layer_elems())?;
        check_len("kv_unpack v_cache", v_cache.len(), g.layer_elems())?;
        if n_blocks == 0 {
            return Ok(());
        }
        let (nb, words) = (i32_of("n_blocks", n_blocks)?, (be / 2) as i64);
        let mut b = self.stream.launch_builder(self.f("kv_unpack")?);
        b.arg(payload)
            .arg(blocks)
            .arg(&nb)
            .arg(&words)
            .arg(k_cache)
            .arg(v_cache);
        // SAFETY: as kv_pack.
        unsafe { b.launch(grid(n_blocks * be / 2, 256)) }
            .map(drop)
            .map_err(driver)
    }

    /// Greedy tokens of `rows` rows of `vocab` logits.
    pub fn argmax(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        rows: usize,
        out: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), CudaError> {
        check_len("argmax logits", logits.len(), rows * vocab)?;
        check_len("argmax out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        let v = i32_of("vocab", vocab)?;
        let mut b = self.stream.launch_builder(self.f("argmax_rows")?);
        b.arg(logits).arg(&v).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }

    /// Temperature / top-k / top-p draws, one per row, with `uniform[r]` in [0, 1) (see
    /// sample.cu). Each parameter buffer holds one value per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        logits: &CudaView<'_, f32>,
        vocab: usize,
        rows: usize,
        temperature: &CudaView<'_, f32>,
        top_k: &CudaView<'_, i32>,
        top_p: &CudaView<'_, f32>,
        uniform: &CudaView<'_, f32>,
        out: &mut CudaViewMut<'_, i32>,
    ) -> Result<(), CudaError> {
        check_len("sample logits", logits.len(), rows * vocab)?;
        for (what, len) in [
            ("temperature", temperature.len()),
            ("top_k", top_k.len()),
            ("top_p", top_p.len()),
            ("uniform", uniform.len()),
            ("out", out.len()),
        ] {
            check_len(what, len, rows)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let v = i32_of("vocab", vocab)?;
        let mut b = self.stream.launch_builder(self.f("sample_rows")?);
        b.arg(logits).arg(&v).arg(temperature).arg(top_k).arg(top_p);
        b.arg(uniform).arg(out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above.
        unsafe { b.launch(cfg) }.map(drop).map_err(driver)
    }
}

//! The RDMA transport on libibverbs (see the module docs one level up for the protocol).
//!
//! Raw verbs (ibverbs-sys) because ibverbs' safe API cannot post RDMA writes. Every handle
//! lives in one `Shared` value, destroyed in dependency order (queue pairs and memory
//! regions, then the completion queue, protection domain and context) after the completion
//! poller thread has stopped.

use super::{RdmaConfig, RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion};
use crate::chunk::KvChunk;
use crate::codec::{CodecLimits, FrameDecoder, FrameEncoder};
use crate::transport::{KvReceiver, Transport, TransportError};
use crossbeam_channel::{Sender, TrySendError};
use ibverbs_sys as ffi;
use kvmesh_common::NodeId;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Receive work requests kept posted per queue pair (each consumes one incoming message).
const RECV_DEPTH: u32 = 64;
const CQ_DEPTH: i32 = 4096;
// Work request ids: the peer's index in the low 32 bits, the kind above.
const WR_WRITE: u64 = 1 << 32;
const WR_CREDIT: u64 = 2 << 32;
const WR_RECV: u64 = 3 << 32;

fn verbs_err(op: &'static str) -> RdmaError {
    RdmaError::Verbs {
        op,
        source: io::Error::last_os_error(),
    }
}

fn errno_err(op: &'static str, errno: i32) -> RdmaError {
    RdmaError::Verbs {
        op,
        source: io::Error::from_raw_os_error(errno),
    }
}

/// Context, protection domain and the one completion queue every queue pair shares.
struct Device {
    name: String,
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    port: u8,
    lid: u16,
    active_mtu: ffi::ibv_mtu,
    gid_index: Option<u8>,
    gid: [u8; 16],
}

impl Device {
    fn open(config: &RdmaConfig) -> Result<Device, RdmaError> {
        // Listing through ibverbs first gives the clear "no device" answer.
        let names: Vec<String> = match ibverbs::devices() {
            Ok(list) => list
                .iter()
                .filter_map(|d| d.name().map(|n| n.to_string_lossy().into_owned()))
                .collect(),
            Err(e) => return Err(RdmaError::NoDevice(e.to_string())),
        };
        if names.is_empty() {
            return Err(RdmaError::NoDevice("the device list is empty".into()));
        }
        let wanted = config.device.clone().unwrap_or_else(|| names[0].clone());
        let mut n = 0i32;
        // SAFETY: plain libibverbs calls; the list is freed below, after the device is open
        // (an open context keeps its device alive).
        unsafe {
            let list = ffi::ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(RdmaError::NoDevice(io::Error::last_os_error().to_string()));
            }
            let mut found = ptr::null_mut();
            for i in 0..n.max(0) as usize {
                let dev = *list.add(i);
                let name = std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(dev));
                if name.to_string_lossy() == wanted {
                    found = dev;
                }
            }
            let ctx = if found.is_null() {
                ptr::null_mut()
            } else {
                ffi::ibv_open_device(found)
            };
            ffi::ibv_free_device_list(list);
            if found.is_null() {
                return Err(RdmaError::NoDevice(format!(
                    "no device named {wanted} (have {names:?})"
                )));
            }
            if ctx.is_null() {
                return Err(verbs_err("ibv_open_device"));
            }
            let mut dev = Device {
                name: wanted,
                ctx,
                pd: ptr::null_mut(),
                cq: ptr::null_mut(),
                port: config.port,
                lid: 0,
                active_mtu: ffi::IBV_MTU_1024,
                gid_index: config.gid_index,
                gid: [0; 16],
            };
            let mut port_attr: ffi::ibv_port_attr = std::mem::zeroed();
            let errno = ffi::ibv_query_port(ctx, dev.port, &mut port_attr as *mut _ as *mut _);
            if errno != 0 {
                return Err(errno_err("ibv_query_port", errno));
            }
            dev.lid = port_attr.lid;
            dev.active_mtu = port_attr.active_mtu;
            if let Some(index) = dev.gid_index {
                let mut gid: ffi::ibv_gid = std::mem::zeroed();
                let errno = ffi::ibv_query_gid(ctx, dev.port, index.into(), &mut gid);
                if errno != 0 {
                    return Err(errno_err("ibv_query_gid", errno));
                }
                dev.gid = gid.raw;
            }
            dev.pd = ffi::ibv_alloc_pd(ctx);
            if dev.pd.is_null() {
                return Err(verbs_err("ibv_alloc_pd"));
            }
            dev.cq = ffi::ibv_create_cq(ctx, CQ_DEPTH, ptr::null_mut(), ptr::null_mut(), 0);
            if dev.cq.is_null() {
                return Err(verbs_err("ibv_create_cq"));
            }
            Ok(dev)
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: created in `open`; every queue pair and region on them is gone by now.
        unsafe {
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// Page-aligned memory registered with the device. Accessed through raw pointers only: the
/// NIC reads and writes it behind Rust's back.
struct Region {
    mr: *mut ffi::ibv_mr,
    ptr: *mut u8,
    len: usize,
}

impl Region {
    fn new(pd: *mut ffi::ibv_pd, len: usize, remote_write: bool) -> Result<Region, RdmaError> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096)
            .map_err(|e| RdmaError::Config(e.to_string()))?;
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_write {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        }
        // SAFETY: a fresh allocation of `layout`, registered for exactly its length.
        unsafe {
            let ptr = std::alloc::alloc_zeroed(layout);
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            let mr = ffi::ibv_reg_mr(pd, ptr.cast(), len, access.0 as i32);
            if mr.is_null() {
                let e = verbs_err("ibv_reg_mr");
                std::alloc::dealloc(ptr, layout);
                return Err(e);
            }
            Ok(Region { mr, ptr, len })
        }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is valid while `self` lives.
        unsafe { (*self.mr).lkey }
    }

    fn descriptor(&self) -> RdmaRegion {
        RdmaRegion {
            addr: self.ptr as u64,
            // SAFETY: as above.
            rkey: unsafe { (*self.mr).rkey },
            len: self.len as u64,
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered and allocated in `new` with this layout.
        unsafe {
            ffi::ibv_dereg_mr(self.mr);
            let layout = std::alloc::Layout::from_size_align_unchecked(self.len.max(1), 4096);
            std::alloc::dealloc(self.ptr, layout);
        }
    }
}

/// Where the next message of `len` bytes goes in a ring of `ring` bytes whose head is at
/// `head`: its offset, and how far the head moves (a message never wraps).
fn place(head: u64, len: u64, ring: u64) -> (u64, u64) {
    let at = head % ring;
    if at + len <= ring {
        (at, len)
    } else {
        (0, ring - at + len)
    }
}

/// The sending side of one peer.
struct Outgoing {
    head: u64,
    /// Bytes of the peer's ring it has handed back.
    freed: u64,
    /// The staging buffer is being written out.
    in_flight: bool,
    failed: Option<String>,
}

/// The receiving side of one peer; only the poller thread touches it.
struct Incoming {
    head: u64,
    /// Chunks decoded but not yet queued (their node's queue is full): the ring space, and
    /// so the sender, waits for them.
    pending: VecDeque<(NodeId, KvChunk, u64)>,
}

struct Peer {
    index: u32,
    qp: *mut ffi::ibv_qp,
    local_psn: u32,
    ring: Region,
    staging: Region,
    remote: Mutex<Option<RdmaRegion>>,
    out: Mutex<Outgoing>,
    changed: Condvar,
    incoming: Mutex<Incoming>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // SAFETY: created in `prepare_peer`; the poller has stopped.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
        }
    }
}

struct Shared {
    // Field order is drop order: peers (queue pairs, regions) before the device.
    peers: RwLock<HashMap<NodeId, Arc<Peer>>>,
    by_index: RwLock<HashMap<u32, Arc<Peer>>>,
    device: Device,
    nodes: RwLock<HashMap<NodeId, Sender<KvChunk>>>,
    config: RdmaConfig,
    stop: AtomicBool,
}

// SAFETY: verbs handles may be used from any thread (libibverbs locks internally); the
// registered memory is only touched under the protocol's ownership rules: the staging buffer
// while no write is in flight, a ring slice between its landing and its credit.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}
unsafe impl Send for Peer {}
unsafe impl Sync for Peer {}

/// See the module docs.
pub struct RdmaTransport {
    shared: Arc<Shared>,
    poller: Option<JoinHandle<()>>,
}

impl RdmaTransport {
    /// Opens the device (`NoDevice` where there is none) and starts the completion poller.
    pub fn open(config: RdmaConfig) -> Result<RdmaTransport, RdmaError> {
        if config.ring_bytes < 1 << 20 {
            return Err(RdmaError::Config(
                "ring_bytes must be at least 1 MiB".into(),
            ));
        }
        let device = Device::open(&config)?;
        let shared = Arc::new(Shared {
            peers: RwLock::default(),
            by_index: RwLock::default(),
            device,
            nodes: RwLock::default(),
            config,
            stop: AtomicBool::new(false),
        });
        let poller = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("kvmesh-rdma".into())
                .spawn(move || poll_loop(&shared))
                .map_err(|source| RdmaError::Verbs {
                    op: "spawn poller",
                    source,
                })?
        };
        Ok(RdmaTransport {
            shared,
            poller: Some(poller),
        })
    }

    pub fn device_name(&self) -> &str {
        &self.shared.device.name
    }

    /// Creates the queue pair and receive ring for `peer`; send the result to the peer.
    pub fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        let s = &self.shared;
        let dev = &s.device;
        let ring = Region::new(dev.pd, s.config.ring_bytes, true)?;
        let staging = Region::new(dev.pd, s.config.ring_bytes, false)?;
        // SAFETY: plain verbs calls on live handles.
        let qp = unsafe {
            let mut attr: ffi::ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = dev.cq;
            attr.recv_cq = dev.cq;
            attr.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
            attr.cap.max_send_wr = RECV_DEPTH + 8;
            attr.cap.max_recv_wr = RECV_DEPTH;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            let qp = ffi::ibv_create_qp(dev.pd, &mut attr);
            if qp.is_null() {
                return Err(verbs_err("ibv_create_qp"));
            }
            qp
        };
        let index = s.by_index.read().unwrap_or_else(|e| e.into_inner()).len() as u32;
        let local_psn = (u64::from(index).wrapping_mul(0x9e37_79b9) & 0xff_ffff) as u32;
        let p = Arc::new(Peer {
            index,
            qp,
            local_psn,
            ring,
            staging,
            remote: Mutex::new(None),
            out: Mutex::new(Outgoing {
                head: 0,
                freed: 0,
                in_flight: false,
                failed: None,
            }),
            changed: Condvar::new(),
            incoming: Mutex::new(Incoming {
                head: 0,
                pending: VecDeque::new(),
            }),
        });
        // SAFETY: the queue pair was just created.
        let qp_num = unsafe { (*qp).qp_num };
        let info = RdmaPeerInfo {
            endpoint: RdmaEndpoint {
                qp_num,
                lid: dev.lid,
                gid: dev.gid,
                psn: local_psn,
            },
            region: p.ring.descriptor(),
        };
        s.by_index
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(index, p.clone());
        s.peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer, p);
        Ok(info)
    }

    /// Connects the queue pair prepared for `peer` to the peer's, and posts its receives.
    pub fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        let p = self.peer(peer).ok_or(RdmaError::NotPrepared(peer))?;
        let dev = &self.shared.device;
        // SAFETY: INIT -> RTR -> RTS on a live queue pair, then receives with no scatter
        // entries (RDMA-write immediates and zero-length sends need none).
        unsafe {
            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_INIT;
            a.pkey_index = 0;
            a.port_num = dev.port;
            a.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE)
                .0;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ffi::ibv_qp_attr_mask::IBV_QP_PORT
                | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let errno = ffi::ibv_modify_qp(p.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(INIT)", errno));
            }

            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = dev.active_mtu;
            a.dest_qp_num = remote.endpoint.qp_num;
            a.rq_psn = remote.endpoint.psn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = remote.endpoint.lid;
            a.ah_attr.port_num = dev.port;
            if let Some(index) = dev.gid_index {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = remote.endpoint.gid;
                a.ah_attr.grh.sgid_index = index;
                a.ah_attr.grh.hop_limit = 64;
            }
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_AV
                | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            let errno = ffi::ibv_modify_qp(p.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(RTR)", errno));
            }

            let mut a: ffi::ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ffi::ibv_qp_state::IBV_QPS_RTS;
            a.sq_psn = p.local_psn;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7; // retry forever while the peer has no receive posted
            a.max_rd_atomic = 1;
            let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            let errno = ffi::ibv_modify_qp(p.qp, &mut a, mask.0 as i32);
            if errno != 0 {
                return Err(errno_err("ibv_modify_qp(RTS)", errno));
            }
            for _ in 0..RECV_DEPTH {
                post_recv(&p)?;
            }
        }
        *p.remote.lock().unwrap_or_else(|e| e.into_inner()) = Some(remote.region);
        Ok(())
    }

    fn peer(&self, node: NodeId) -> Option<Arc<Peer>> {
        self.shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&node)
            .cloned()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(poller) = self.poller.take() {
            let _ = poller.join();
        }
    }
}

impl Transport for RdmaTransport {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        let mut nodes = self.shared.nodes.write().unwrap_or_else(|e| e.into_inner());
        if nodes.contains_key(&node) {
            return Err(TransportError::AlreadyBound(node));
        }
        let (tx, rx) = crossbeam_channel::bounded(self.shared.config.queue_chunks.max(1));
        nodes.insert(node, tx);
        Ok(rx)
    }

    fn unbind(&self, node: NodeId) {
        let mut nodes = self.shared.nodes.write().unwrap_or_else(|e| e.into_inner());
        nodes.remove(&node);
    }

    /// Waits for the staging buffer and for room in the peer's ring, copies the encoded chunk
    /// into the staging buffer and posts the write; returns once it is posted.
    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        let p = self.peer(dest).ok_or(TransportError::Unreachable(dest))?;
        let remote = (*p.remote.lock().unwrap_or_else(|e| e.into_inner()))
            .ok_or(TransportError::Unreachable(dest))?;
        let mut head = Vec::new();
        let limits = self.shared.config.limits;
        FrameEncoder::with_limits(dest, chunk.header.request_id, limits)
            .encode_head(&chunk, &mut head)
            .map_err(TransportError::Invalid)?;
        let len = (head.len() + chunk.payload.len()) as u64;
        if len > remote.len.min(p.staging.len as u64) || len > u64::from(u32::MAX) {
            return Err(TransportError::Invalid(
                crate::codec::CodecError::TooLarge {
                    what: "message bytes (RDMA ring)",
                    got: len,
                    max: remote.len.min(p.staging.len as u64),
                },
            ));
        }
        let mut out = p.out.lock().unwrap_or_else(|e| e.into_inner());
        let (offset, advance) = loop {
            if let Some(why) = &out.failed {
                return Err(TransportError::Connection {
                    node: dest,
                    reason: why.clone(),
                });
            }
            let (offset, advance) = place(out.head, len, remote.len);
            let free = remote.len - (out.head - out.freed);
            if !out.in_flight && advance <= free {
                break (offset, advance);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout(dest));
            }
            out = p
                .changed
                .wait_timeout(out, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        // SAFETY: no write is in flight, so the staging buffer is ours; `len` fits it.
        unsafe {
            ptr::copy_nonoverlapping(head.as_ptr(), p.staging.ptr, head.len());
            ptr::copy_nonoverlapping(
                chunk.payload.as_ptr(),
                p.staging.ptr.add(head.len()),
                chunk.payload.len(),
            );
        }
        let mut sge = ffi::ibv_sge {
            addr: p.staging.ptr as u64,
            length: len as u32,
            lkey: p.staging.lkey(),
        };
        // SAFETY: the work request and scatter entry outlive the call; the staging buffer
        // stays untouched until the write's completion clears `in_flight`.
        let errno = unsafe {
            let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
            wr.wr_id = WR_WRITE | u64::from(p.index);
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.__bindgen_anon_1.imm_data = (len as u32).to_be();
            wr.wr.rdma.remote_addr = remote.addr + offset;
            wr.wr.rdma.rkey = remote.rkey;
            post_send(p.qp, &mut wr)
        };
        if errno != 0 {
            return Err(TransportError::Connection {
                node: dest,
                reason: io::Error::from_raw_os_error(errno).to_string(),
            });
        }
        out.in_flight = true;
        out.head += advance;
        Ok(())
    }
}

/// SAFETY: `qp` is live and `wr` valid for the call.
unsafe fn post_send(qp: *mut ffi::ibv_qp, wr: &mut ffi::ibv_send_wr) -> i32 {
    let mut bad = ptr::null_mut();
    // SAFETY: per the function's contract; ops are filled in by the provider.
    unsafe {
        let ctx = (*qp).context;
        match (*ctx).ops.post_send {
            Some(f) => f(qp, wr, &mut bad),
            None => libc_enosys(),
        }
    }
}

fn libc_enosys() -> i32 {
    38 // ENOSYS
}

/// Posts one receive (no scatter entries) on `p`'s queue pair.
fn post_recv(p: &Peer) -> Result<(), RdmaError> {
    // SAFETY: a live queue pair; the work request is valid for the call.
    let errno = unsafe {
        let mut wr: ffi::ibv_recv_wr = std::mem::zeroed();
        wr.wr_id = WR_RECV | u64::from(p.index);
        let mut bad = ptr::null_mut();
        let ctx = (*p.qp).context;
        match (*ctx).ops.post_recv {
            Some(f) => f(p.qp, &mut wr, &mut bad),
            None => libc_enosys(),
        }
    };
    if errno != 0 {
        return Err(errno_err("ibv_post_recv", errno));
    }
    Ok(())
}

/// Hands `freed` bytes of `p`'s ring back to the sender with a zero-length SEND_WITH_IMM.
fn post_credit(p: &Peer, freed: u64) -> Result<(), RdmaError> {
    // SAFETY: a live queue pair; the work request is valid for the call.
    let errno = unsafe {
        let mut wr: ffi::ibv_send_wr = std::mem::zeroed();
        wr.wr_id = WR_CREDIT | u64::from(p.index);
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.__bindgen_anon_1.imm_data = (freed as u32).to_be();
        post_send(p.qp, &mut wr)
    };
    if errno != 0 {
        return Err(errno_err("ibv_post_send(credit)", errno));
    }
    Ok(())
}

/// The completion poller: landed messages, returned credits, finished writes. Spins briefly
/// when idle, then naps, so an idle transport costs little CPU.
fn poll_loop(s: &Shared) {
    // SAFETY: ibv_wc is plain data.
    let mut wcs: Vec<ffi::ibv_wc> = vec![unsafe { std::mem::zeroed() }; 32];
    let mut idle = 0u32;
    while !s.stop.load(Ordering::Relaxed) {
        let mut busy = flush_pending(s);
        // SAFETY: the completion queue is live until `Shared` drops, after this thread.
        let n = unsafe {
            let ctx = (*s.device.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(s.device.cq, wcs.len() as i32, wcs.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            tracing::error!(device = %s.device.name, "ibv_poll_cq failed; RDMA transport stopped");
            return;
        }
        for wc in &wcs[..n as usize] {
            handle_completion(s, wc);
            busy = true;
        }
        if busy {
            idle = 0;
        } else {
            idle = idle.saturating_add(1);
            if idle > 1000 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

fn handle_completion(s: &Shared, wc: &ffi::ibv_wc) {
    let index = (wc.wr_id() & 0xffff_ffff) as u32;
    let Some(p) = s
        .by_index
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&index)
        .cloned()
    else {
        return;
    };
    if let Some((status, vendor)) = wc.error() {
        let why = format!("work completion status {status} (vendor {vendor})");
        tracing::warn!(device = %s.device.name, %why, "RDMA transfer failed");
        let mut out = p.out.lock().unwrap_or_else(|e| e.into_inner());
        out.failed = Some(why);
        out.in_flight = false;
        p.changed.notify_all();
        return;
    }
    match wc.wr_id() & !0xffff_ffff {
        WR_WRITE => {
            p.out.lock().unwrap_or_else(|e| e.into_inner()).in_flight = false;
            p.changed.notify_all();
        }
        WR_RECV => {
            let imm = wc.imm_data().map(u32::from_be);
            if wc.opcode() == ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                if let Some(len) = imm {
                    landed(s, &p, u64::from(len));
                }
            } else if let Some(freed) = imm {
                // A credit: the peer consumed what we wrote.
                p.out.lock().unwrap_or_else(|e| e.into_inner()).freed += u64::from(freed);
                p.changed.notify_all();
            }
            if let Err(e) = post_recv(&p) {
                tracing::warn!(error = %e, "cannot repost an RDMA receive");
            }
        }
        _ => {} // credit sends completing
    }
}

/// A message of `len` bytes landed in `p`'s ring: decode it, queue its chunk (or keep it
/// pending), and hand the space back once queued.
fn landed(s: &Shared, p: &Peer, len: u64) {
    let mut incoming = p.incoming.lock().unwrap_or_else(|e| e.into_inner());
    let (offset, advance) = place(incoming.head, len, p.ring.len as u64);
    incoming.head += advance;
    if offset + len > p.ring.len as u64 {
        tracing::warn!(len, "RDMA message larger than the ring; dropped");
        return;
    }
    // SAFETY: the sender wrote these bytes before the completion that brought us here, and
    // will not write them again until we return the space.
    let bytes =
        unsafe { std::slice::from_raw_parts(p.ring.ptr.add(offset as usize), len as usize) };
    match decode_one(bytes, s.config.limits) {
        Ok((dest, chunk)) => {
            incoming.pending.push_back((dest, chunk, advance));
            drop(incoming);
            deliver_pending(s, p);
        }
        Err(e) => {
            tracing::warn!(error = %e, "malformed RDMA KV message; dropped");
            let _ = post_credit(p, advance);
        }
    }
}

fn decode_one(bytes: &[u8], limits: CodecLimits) -> Result<(NodeId, KvChunk), String> {
    let mut decoder = FrameDecoder::new(limits);
    decoder.push(bytes);
    let chunk = decoder
        .next_chunk()
        .map_err(|e| e.to_string())?
        .ok_or("a truncated message")?;
    decoder.finish().map_err(|e| e.to_string())?;
    let dest = decoder.preamble().ok_or("no preamble")?.dest;
    Ok((dest, chunk))
}

/// Queues `p`'s pending chunks in order while their nodes' queues have room; true if any
/// moved.
fn deliver_pending(s: &Shared, p: &Peer) -> bool {
    let mut incoming = p.incoming.lock().unwrap_or_else(|e| e.into_inner());
    let mut moved = false;
    while let Some((dest, chunk, advance)) = incoming.pending.pop_front() {
        let queue = s
            .nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&dest)
            .cloned();
        match queue.map(|q| q.try_send(chunk)) {
            Some(Err(TrySendError::Full(chunk))) => {
                incoming.pending.push_front((dest, chunk, advance));
                break;
            }
            Some(Ok(())) => {}
            // A one-sided write cannot be refused; the decode side times out and recomputes.
            None | Some(Err(TrySendError::Disconnected(_))) => {
                tracing::warn!(node = %dest, "RDMA KV chunk for a node not bound here; dropped");
            }
        }
        moved = true;
        if let Err(e) = post_credit(p, advance) {
            tracing::warn!(error = %e, "cannot return RDMA ring space");
        }
    }
    moved
}

fn flush_pending(s: &Shared) -> bool {
    let peers: Vec<Arc<Peer>> = s
        .by_index
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .cloned()
        .collect();
    let mut moved = false;
    for p in peers {
        moved |= deliver_pending(s, &p);
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::place;

    #[test]
    fn messages_never_wrap_the_ring() {
        assert_eq!(place(0, 10, 100), (0, 10));
        assert_eq!(place(90, 10, 100), (90, 10));
        assert_eq!(place(95, 10, 100), (0, 15));
        assert_eq!(place(205, 10, 100), (5, 10));
    }
}

//! The RDMA transport where it cannot run (no device here, or not compiled in) and the
//! fallback to QUIC. The data path needs an RDMA NIC (or rdma_rxe) to test.

use kvmesh_transfer::{
    select, QuicConfig, RdmaConfig, RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion,
    RdmaTransport, TransportKind,
};
use std::net::SocketAddr;

#[cfg(feature = "rdma")]
#[test]
fn without_a_device_open_says_so_and_points_to_quic() {
    match RdmaTransport::open(RdmaConfig::default()) {
        Err(e @ RdmaError::NoDevice(_)) => {
            let msg = e.to_string();
            assert!(msg.starts_with("no RDMA device found ("), "{msg}");
            assert!(msg.ends_with("falling back to QUIC"), "{msg}");
        }
        Err(e) => panic!("expected NoDevice, got {e}"),
        Ok(t) => eprintln!(
            "RDMA device {} present; nothing to check here",
            t.device_name()
        ),
    }
}

#[cfg(not(feature = "rdma"))]
#[test]
fn without_the_feature_open_says_so() {
    let e = RdmaTransport::open(RdmaConfig::default()).err().unwrap();
    assert!(matches!(e, RdmaError::NotCompiled));
    assert!(e.to_string().contains("falling back to QUIC"));
}

#[test]
fn select_falls_back_to_quic() {
    let quic = QuicConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..QuicConfig::default()
    };
    let rdma_opens = RdmaTransport::open(RdmaConfig::default()).is_ok();
    let t = select(TransportKind::Rdma, RdmaConfig::default(), quic.clone()).unwrap();
    if !rdma_opens {
        assert_eq!(t.kind(), TransportKind::Quic);
    }
    let t = select(TransportKind::Quic, RdmaConfig::default(), quic).unwrap();
    assert_eq!(t.kind(), TransportKind::Quic);
}

#[test]
fn peer_info_travels_as_json() {
    let info = RdmaPeerInfo {
        endpoint: RdmaEndpoint {
            qp_num: 0x1234,
            lid: 7,
            gid: [0xfe; 16],
            psn: 99,
        },
        region: RdmaRegion {
            addr: 0x7f00_0000_1000,
            rkey: 0xabcd,
            len: 128 << 20,
        },
    };
    let json = serde_json::to_string(&info).unwrap();
    assert_eq!(serde_json::from_str::<RdmaPeerInfo>(&json).unwrap(), info);
}

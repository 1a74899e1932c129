//! Load generation, trace replay, SLO sweeps and the discrete-event simulator.
//!
//! The engine benchmark (`kvmesh bench engine`) lives in the CLI for now; the comparison with
//! llama.cpp is `bench/engine_vs_llamacpp.sh`. Load generation and trace replay arrive with
//! `kvmesh serve`.

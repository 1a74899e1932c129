//! Autoscaling: reads TTFT/ITL/queue/KV-usage metrics and sets the number of prefill and
//! decode nodes through an actuator (local processes, docker compose, Kubernetes).
//!
//! Not built yet.

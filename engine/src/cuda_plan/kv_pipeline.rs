//! The order of one step's work on the CUDA backend's two streams, so a layer's KV is packed
//! for the transport while the next layer computes.
//!
//! The compute stream runs the layers; after layer `l` appends its KV it records event
//! `appended[l]`. The copy stream waits on that event, packs the blocks the observer asks
//! for into a device staging buffer and copies them to pinned host memory; only then does
//! the host hand them over (the observer's `on_layer(l)`), and it does so after queueing
//! layer `l + 1`, so the device computes `l + 1` while the copy stream serves `l`. The host
//! thread blocks only on the copy stream, never on the compute stream, until the step's
//! logits.

/// One thing the host does, in order, during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepOp {
    /// Queue the embedding gather on the compute stream.
    Embed,
    /// Queue layer `l` on the compute stream up to and including its KV append.
    AppendKv(usize),
    /// Record `appended[l]` on the compute stream.
    RecordAppended(usize),
    /// Queue the rest of layer `l` (attention, projection, MLP) on the compute stream.
    FinishLayer(usize),
    /// Call the observer for layer `l`: each of its reads makes the copy stream wait on
    /// `appended[l]`, pack and copy to pinned memory, and the host wait on the copy stream.
    Deliver(usize),
    /// Queue the final norm and LM head on the compute stream.
    QueueHead,
    /// Copy the logits back, waiting on the compute stream.
    ReadLogits,
}

/// The step's plan for `num_layers` layers: each layer delivered one layer late (after the
/// next one is queued), the last one after the LM head is queued.
pub fn step_plan(num_layers: usize) -> Vec<StepOp> {
    let mut plan = Vec::with_capacity(4 * num_layers + 3);
    plan.push(StepOp::Embed);
    for l in 0..num_layers {
        plan.push(StepOp::AppendKv(l));
        plan.push(StepOp::RecordAppended(l));
        plan.push(StepOp::FinishLayer(l));
        if l > 0 {
            plan.push(StepOp::Deliver(l - 1));
        }
    }
    // The LM head is queued first, so the copy stream serves the last layer while it runs.
    plan.push(StepOp::QueueHead);
    if let Some(last) = num_layers.checked_sub(1) {
        plan.push(StepOp::Deliver(last));
    }
    plan.push(StepOp::ReadLogits);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(plan: &[StepOp], op: StepOp) -> usize {
        plan.iter()
            .position(|&o| o == op)
            .unwrap_or_else(|| panic!("{op:?} not in the plan"))
    }

    /// Where `op` is, or the plan's end when it is not there (past the last layer).
    fn at_or_end(plan: &[StepOp], op: StepOp) -> usize {
        plan.iter().position(|&o| o == op).unwrap_or(plan.len())
    }

    #[test]
    fn every_layer_is_delivered_once_in_order_after_its_kv_is_recorded() {
        for layers in [1, 2, 30, 32] {
            let plan = step_plan(layers);
            let delivered: Vec<usize> = plan
                .iter()
                .filter_map(|o| match o {
                    StepOp::Deliver(l) => Some(*l),
                    _ => None,
                })
                .collect();
            assert_eq!(delivered, (0..layers).collect::<Vec<_>>());
            for l in 0..layers {
                assert!(at(&plan, StepOp::AppendKv(l)) < at(&plan, StepOp::RecordAppended(l)));
                assert!(at(&plan, StepOp::RecordAppended(l)) < at(&plan, StepOp::Deliver(l)));
            }
        }
    }

    #[test]
    fn a_layer_is_delivered_while_the_next_one_computes() {
        let plan = step_plan(30);
        for l in 0..29 {
            // Layer l + 1 is queued in full before the host waits on layer l's pack ...
            assert!(at(&plan, StepOp::FinishLayer(l + 1)) < at(&plan, StepOp::Deliver(l)));
            // ... and no more than one layer ahead: the host hands each layer over before it
            // queues the one after next, so a slow transport holds back one layer, not all.
            assert!(at(&plan, StepOp::Deliver(l)) < at_or_end(&plan, StepOp::AppendKv(l + 2)));
        }
    }

    #[test]
    fn the_head_runs_beside_the_last_delivery_and_the_logits_come_last() {
        let plan = step_plan(4);
        assert_eq!(plan.first(), Some(&StepOp::Embed));
        assert_eq!(plan.last(), Some(&StepOp::ReadLogits));
        assert_eq!(plan.len(), 4 * 4 + 3);
        assert!(at(&plan, StepOp::FinishLayer(3)) < at(&plan, StepOp::QueueHead));
        assert!(at(&plan, StepOp::QueueHead) < at(&plan, StepOp::Deliver(3)));
        assert_eq!(
            step_plan(0),
            vec![StepOp::Embed, StepOp::QueueHead, StepOp::ReadLogits]
        );
    }
}

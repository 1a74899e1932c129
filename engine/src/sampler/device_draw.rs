//! Which draws a device may make itself: greedy and temperature / top-k / top-p over the raw
//! logits. Anything that reads or rewrites the logits on the host first (a bias, penalties,
//! min-p, the `min_tokens` mask, log-probabilities, a format's mask, top logits for the
//! response) keeps the draw on the host.

use kvmesh_common::SamplingParams;

/// What a device draw needs of a sequence's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawParams {
    /// 0: greedy (the first maximum, as the host's `argmax`).
    pub temperature: f32,
    /// 0: all tokens; 1: greedy.
    pub top_k: u32,
    /// 1.0: all the mass.
    pub top_p: f32,
}

/// The device draw for a sequence with `params`, `generated` tokens so far and
/// `top_logits` top logits asked for its response; `None` when the host must draw.
pub fn device_draw(
    params: &SamplingParams,
    generated: usize,
    top_logits: usize,
) -> Option<DrawParams> {
    let host_only = !params.logit_bias.is_empty()
        || params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0
        || params.min_p > 0.0
        || (generated as u64) < u64::from(params.min_tokens)
        || params.logprobs.is_some()
        || params.constraint.is_some()
        || top_logits > 0;
    if host_only {
        return None;
    }
    Some(if params.is_greedy() {
        DrawParams {
            temperature: 0.0,
            top_k: 1,
            top_p: 1.0,
        }
    } else {
        DrawParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::sampling::Constraint;

    fn sampled() -> SamplingParams {
        SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            max_tokens: 8,
            ..Default::default()
        }
    }

    #[test]
    fn plain_greedy_and_truncated_draws_go_to_the_device() {
        let greedy = device_draw(&SamplingParams::greedy(8), 0, 0).unwrap();
        assert_eq!((greedy.temperature, greedy.top_k), (0.0, 1));
        let one = SamplingParams {
            top_k: 1,
            ..sampled()
        };
        assert_eq!(device_draw(&one, 0, 0).unwrap().temperature, 0.0);
        assert_eq!(
            device_draw(&sampled(), 3, 0),
            Some(DrawParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9
            })
        );
    }

    #[test]
    fn anything_that_touches_the_logits_on_the_host_keeps_the_draw_there() {
        let host: Vec<SamplingParams> = vec![
            SamplingParams {
                logit_bias: vec![(3, 1.0)],
                ..sampled()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..sampled()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..sampled()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..sampled()
            },
            SamplingParams {
                min_p: 0.05,
                ..sampled()
            },
            SamplingParams {
                logprobs: Some(0),
                ..sampled()
            },
            SamplingParams {
                constraint: Some(Constraint::JsonObject),
                ..sampled()
            },
        ];
        for p in &host {
            assert_eq!(device_draw(p, 0, 0), None, "{p:?}");
        }
        assert_eq!(device_draw(&sampled(), 0, 5), None, "top logits asked");
        let min_tokens = SamplingParams {
            min_tokens: 2,
            ..sampled()
        };
        assert_eq!(device_draw(&min_tokens, 1, 0), None, "EOS still masked");
        assert!(device_draw(&min_tokens, 2, 0).is_some());
    }
}

"""SGLang 0.5.23's replies, in the shape its source builds them (written by hand from
tokenizer_manager.py and http_server.py, not recorded): what the protocol tests parse and the contract test
checks against sglang's own classes. ``tests/sglang/record_replies.py`` records real ones (a batch, an abort, a
sample parked across a weight-version change) into ``tests/sglang_recordings.json`` on a CPU that runs SGLang;
rlsys's parsing of live replies of those kinds is checked in ``tests/sglang`` on every such machine."""

# A /generate reply of sglang 0.5.23 for 2 prompts x n=2, in the shape TokenizerManager builds it
# (sglang/srt/managers/tokenizer_manager.py): prompt-major, text + output_ids + meta_info, logprob
# triples [logprob, token_id, null] (return_text_in_logprobs off). Sample 3 was aborted by a pause and
# spans a weight update (weight_versions).
RECORDED_GENERATE_REPLY = [
    {
        "text": " 4",
        "output_ids": [220, 19, 151645],
        "meta_info": {
            "id": "9f1c0a7e3b2d4c5e8a6f1b2c3d4e5f60",
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": 5,
            "weight_version": "3",
            "num_retractions": 0,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.25, 220, None], [-0.011, 19, None], [-0.0004, 151645, None]],
            "e2e_latency": 0.084,
        },
    },
    {
        "text": " four",
        "output_ids": [3040, 3040, 3040, 3040],
        "meta_info": {
            "id": "1a2b3c4d5e6f708192a3b4c5d6e7f801",
            "finish_reason": {"type": "length", "length": 4},
            "prompt_tokens": 5,
            "weight_version": "3",
            "num_retractions": 0,
            "completion_tokens": 4,
            "cached_tokens": 5,
            "output_token_logprobs": [[-1.5, 3040, None], [-2.0, 3040, None], [-2.5, 3040, None], [-3.0, 3040, None]],
            "e2e_latency": 0.091,
        },
    },
    {
        "text": "yes",
        "output_ids": [9454, 151645],
        "meta_info": {
            "id": "b0c1d2e3f405162738495a6b7c8d9e0f",
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": 3,
            "weight_version": "3",
            "num_retractions": 0,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, 9454, None], [-0.125, 151645, None]],
            "e2e_latency": 0.05,
        },
    },
    {
        "text": "no",
        "output_ids": [2152],
        "meta_info": {
            "id": "c1d2e3f405162738495a6b7c8d9e0f1a",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue", "status_code": 200},
            "prompt_tokens": 3,
            "weight_version": "4",
            "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 1}],
            "num_retractions": 0,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.75, 2152, None]],
            "e2e_latency": 0.03,
        },
    },
]
RECORDED_PROMPTS = [[151644, 17, 10, 17, 28], [151644, 3838, 30]]

# Replies to the other endpoints, as sglang/srt/entrypoints/http_server.py writes them.
RECORDED_SERVER_INFO = {"model_path": "/models/Qwen2.5-0.5B", "version": "0.5.23", "frontend": "python"}
RECORDED_MODEL_INFO = {"model_path": "/models/Qwen2.5-0.5B", "weight_version": "default", "is_generation": True}

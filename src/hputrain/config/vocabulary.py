"""The Hugging Face Trainer's vocabulary that hputrain does not take.

Names from Hugging Face's TrainingArguments and Trainer (transformers 4 and 5) and Optimum for Intel
Gaudi's GaudiTrainingArguments, each with the rest of a line that says what to use instead, so
that a name a user brings from there is one line, never a bare TypeError. The names hputrain does
take are fields of TrainingArguments (optim, warmup_ratio, eval_strategy, report_to, ...).
"""
from __future__ import annotations

from . import names

_YET = "is not supported yet"
_FP16 = "is not supported: use bf16=True (Gaudi has no fp16 training path)"
_BEST = ("is not supported: save with save_steps or save_strategy='epoch' and set "
         "load_best_model_at_end=True with metric_for_best_model")
_CHECKPOINTING = "is not needed: gradient_checkpointing=True checkpoints non-reentrant (use_reentrant=False)"
_ACTIVATION = "is spelled gradient_checkpointing here (with gradient_checkpointing_every)"
_SCALE = f"{_YET}: strategy is one of {', '.join(names.STRATEGIES)}, with context_parallel_size"
_FSDP_CONFIG = ("is not taken: its settings are fields here: fsdp (full_shard, shard_grad_op, "
                "hybrid_shard), fsdp_reshard_after_forward, fsdp_cpu_offload, fsdp_init_on_meta, "
                "fsdp_block_classes, gradient_checkpointing")
_FSDP_WRAP = ("is not needed: fsdp shards one transformer block at a time (fsdp_block_classes "
              "names them)")
_HUB = "is not supported: hputrain works offline; upload output_dir with huggingface_hub.upload_folder"
_GENERIC = """average_tokens_across_devices use_liger_kernel liger_kernel_config use_cache
    neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size logging_first_step
    log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level
    log_level_replica project trackio_space_id trackio_bucket_id trackio_static_space_id eval_delay
    prediction_loss_only eval_on_start eval_do_concat_batches eval_use_gather_object
    eval_accumulation_steps include_for_metrics include_inputs_for_metrics batch_eval_metrics
    save_only_model save_on_each_node enable_jit_checkpoint ignore_data_skip
    restore_callback_states_from_checkpoint full_determinism dataloader_drop_last
    dataloader_persistent_workers 
    dataloader_multiprocessing_context dataloader_in_order label_names train_sampling_strategy
    group_by_length length_column_name ddp_broadcast_buffers ddp_static_graph debug
    skip_memory_metrics past_index ray_scope torchdynamo split_batches dispatch_batches
    include_tokens_per_second use_legacy_prediction_loop mp_parameters use_ipex jit_mode_eval
    use_compiled_autograd compile_dynamic compile_from_sec_iteration
    disable_tensor_cache_hpu_graphs max_hpu_graphs ignore_eos profiling_warmup_steps_eval
    profiling_steps_eval sdp_on_bf16 use_regional_compilation cache_size_limit
    use_zero3_leaf_promotion inline_inbuilt_nn_modules allow_unspec_int_on_nn_module"""

TRAINING_ARGUMENTS = {name: _YET for name in _GENERIC.split()} | {
    "fp16": _FP16, "fp16_full_eval": _FP16, "fp16_opt_level": _FP16, "fp16_backend": _FP16,
    "half_precision_backend": "is not needed: bf16=True uses the device's autocast",
    "bf16_full_eval": f"{_YET}: evaluation runs in the training precision (bf16=True)",
    "tf32": f"{_YET}: call torch.set_float32_matmul_precision('high') in your script",
    "gradient_checkpointing_kwargs": _CHECKPOINTING, "activation_checkpointing": _ACTIVATION,
    "activation_checkpointing_kwargs": _CHECKPOINTING,
    "fsdp_config": _FSDP_CONFIG, "fsdp_min_num_params": _FSDP_WRAP, "deepspeed": _SCALE,
    "parallelism_config": _SCALE,
    "sharded_ddp": _SCALE, "distribution_strategy": "is spelled strategy here ('ddp', 'fast_ddp' or 'fsdp')",
    "push_to_hub": _HUB, "push_to_hub_model_id": _HUB, "push_to_hub_organization": _HUB,
    "push_to_hub_token": _HUB, "hub_model_id": _HUB, "hub_strategy": _HUB, "hub_token": _HUB,
    "hub_private_repo": _HUB, "hub_always_push": _HUB, "hub_revision": _HUB,
    "per_gpu_train_batch_size": "was renamed: use per_device_train_batch_size",
    "per_gpu_eval_batch_size": "was renamed: use per_device_eval_batch_size",
    "evaluation_strategy": "was renamed: use eval_strategy (or eval_steps)",
    "use_mps_device": "is not supported: use accelerator='mps'",
    "xpu_backend": "was removed: use ddp_backend",
    "tpu_num_cores": "is not supported: hputrain runs on Gaudi, CUDA, MPS and CPU",
    "tpu_metrics_debug": "is not supported: hputrain runs on Gaudi, CUDA, MPS and CPU",
    "use_hpu_graphs": "is spelled use_graphs_for_inference here",
    "use_hpu_graphs_for_inference": "is spelled use_graphs_for_inference here",
    "use_hpu_graphs_for_training": "is spelled use_graphs_for_training here",
    "gaudi_config_name": "is not taken: pass Trainer(accelerator_config=AcceleratorConfig"
                         ".from_file(PATH)), or --accelerator-config PATH",
    "accelerator_config": "is the Trainer's argument here: Trainer(accelerator_config="
                          "AcceleratorConfig(...)), or --accelerator-config PATH (a GaudiConfig file)",
    "adjust_throughput": "is not needed: throughput always leaves out logging, evaluation and saving",
    "local_rank": "is not needed: `hputrain launch` sets LOCAL_RANK and the trainer reads it",
    "logging_dir": "is not needed: metrics.jsonl and tensorboard/ are written to output_dir",
    "save_safetensors": "is not needed: checkpoints are always safetensors",
    "label_smoothing_factor": f"{_YET}: pass Trainer(compute_loss=...) with "
                              "torch.nn.functional.cross_entropy(..., label_smoothing=...)",
    "lr_scheduler_kwargs": f"{_YET}: lr_scheduler_type is one of {', '.join(names.SCHEDULES)}",
    "adafactor": "was removed: hputrain trains with AdamW (see optim)",
    "optim_args": f"{_YET}: AdamW takes learning_rate, weight_decay and adam_*",
    "optim_target_modules": f"{_YET}: AdamW takes learning_rate, weight_decay and adam_*",
    "torch_compile_mode": f"{_YET}: torch_compile=True compiles in the default mode",
    "data_seed": f"{_YET}: seed sets the data order too",
    "run_name": f"{_YET}: a run is named by its output_dir",
    # run_clm.py's model arguments for Gaudi's kernels (docs/migrating.md)
    "use_flash_attention": "is fused_kernels here (on by default: FusedSDPA on Gaudi)",
    "flash_attention_recompute": "is spelled attention_recompute here",
    "flash_attention_causal_mask": "is not needed: the kernel is told whenever the mask is causal",
    "flash_attention_fast_softmax": "is not a switch here: put softmax in autocast_bf16_ops",
    "use_fused_rms_norm": "is fused_kernels here (on by default: FusedRMSNorm on Gaudi)",
    "use_fused_rope": "is not available: transformers has no public hook on its rotary "
                      "embeddings (docs/kernels.md)",
}
_DPO_NOT_HERE = "is not computed here (hputrain's DPO: beta, loss_type, label_smoothing)"
DPO_CONFIG = {
    **{name: _DPO_NOT_HERE for name in """rpo_alpha ld_alpha use_weighting f_divergence_type
        f_alpha_divergence_coef loss_weights discopop_tau sync_ref_model ref_model_mixup_alpha
        ref_model_sync_steps use_liger_loss base_model_attribute_name""".split()},
    "max_completion_length": "is not taken: max_length cuts prompt + completion (keep_start)",
    "truncation_mode": "is keep_start always (TRL deprecates keep_end)",
    "padding_free": "is not needed: pairs are padded to a few static lengths (lazy mode compiles a "
                    "bounded set of graphs)",
    "precompute_ref_batch_size": "is per_device_eval_batch_size here",
    "model_init_kwargs": "is not taken: pass the model itself",
    "ref_model_init_kwargs": "is not taken: pass ref_model itself",
    "generate_during_eval": "is not supported: generate with `hputrain generate --model final/`",
    "dataset_num_proc": "is not taken: DPOTrainer encodes the rows it is given in the main process "
                        "(hputrain train --dataset-num-proc N tokenizes once per node, in N processes)",
}
"""TRL's DPOConfig names DPOConfig does not take, beside the Trainer's (TRAINING_ARGUMENTS)."""
_VLLM = ("is not there: vLLM is not used; generation runs on hputrain's static-shape engine (a "
         "static KV cache, the decode step one graph)")
_ENGINE = "is not needed: generation runs on hputrain's static-shape engine (a static KV cache)"
_GRPO_NOT_HERE = ("is not computed here (hputrain's GRPO: beta, epsilon, epsilon_high, delta, "
                  "loss_type dapo, grpo, bnpo or dr_grpo)")
_COMPLETIONS = "is not needed: hputrain writes every completion to output_dir/completions.jsonl"
_TOOLS = "is not supported: completions are generated in one turn (no tool calls)"
_REFERENCE = "is not supported: the reference stays the starting weights (used when beta > 0)"
_TRL_MODEL = "is not taken: pass the model itself"
GRPO_CONFIG = {
    **{name: _VLLM for name in """use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
        vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port
        vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
        vllm_tensor_parallel_size vllm_importance_sampling_correction vllm_importance_sampling_mode
        vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min
        vllm_importance_sampling_cap vllm_guided_decoding_regex vllm_device vllm_dtype""".split()},
    **{name: _ENGINE for name in """use_transformers_continuous_batching
        transformers_continuous_batching_config use_transformers_paged cache_implementation""".split()},
    **{name: _GRPO_NOT_HERE for name in """sapo_temperature_neg sapo_temperature_pos vespo_k_pos
        vespo_lambda_pos vespo_k_neg vespo_lambda_neg top_entropy_quantile entropy_coef
        use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
        off_policy_mask_threshold""".split()},
    **{name: _COMPLETIONS for name in """log_completions log_multimodal num_completions_to_print
        log_unique_prompts wandb_log_unique_prompts""".split()},
    "log_completions_hub_repo": _HUB,
    "tools": _TOOLS, "max_tool_calling_iterations": _TOOLS,
    "sync_ref_model": _REFERENCE, "ref_model_mixup_alpha": _REFERENCE, "ref_model_sync_steps": _REFERENCE,
    "generation_kwargs": "is not taken: sampling is set by temperature, top_p, top_k, min_p and "
                         "repetition_penalty",
    "chat_template_kwargs": f"{_YET}: conversational prompts go through the tokenizer's chat "
                            "template with its defaults",
    "max_prompt_length": "is prompt_buckets here: a prompt is padded to the nearest bucket, the "
                         "largest bounds its length",
    "model_init_kwargs": _TRL_MODEL, "trust_remote_code": _TRL_MODEL,
    "router_aux_loss_coef": _YET, "cast_lm_head_to_fp32": _YET,
    "use_liger_loss": "is not needed: log-probs are taken on completion positions only, in chunks",
    "ds3_gather_for_generation": "is not needed: DeepSpeed is not used (strategy='fsdp' gathers "
                                 "the weights it generates with)",
    "shuffle_dataset": f"{_YET}: the training prompts are shuffled with seed",
}
"""TRL's GRPOConfig names GRPOConfig does not take, beside the Trainer's (TRAINING_ARGUMENTS)."""
GRPO_TRAINER_KWARGS = {
    "tools": _TOOLS,
    "rollout_func": "is not supported: completions come from hputrain's static-shape engine",
    "environment_factory": _TOOLS,
    "quantization_config": "is not supported: load the model in the precision to train (bf16=True)",
}
"""TRL's GRPOTrainer keywords that hputrain's GRPO trainer does not take, beside TRAINER_KWARGS."""
REWARD_CONFIG = {
    "model_init_kwargs": _TRL_MODEL, "trust_remote_code": _TRL_MODEL,
    "chat_template_path": "is not taken: give processing_class a tokenizer with its chat_template "
                          "set (hputrain train --chat-template FILE)",
    "dataset_num_proc": "is not taken: the reward trainer encodes the rows it is given in the main "
                        "process (hputrain train --dataset-num-proc N tokenizes once per node)",
    "eos_token": "is not taken: the tokenizer's eos_token ends each sequence",
    "pad_token": "is not taken: set tokenizer.pad_token (TRL deprecates it too)",
    "activation_offloading": f"{_YET}: gradient_checkpointing=True saves activation memory",
}
"""TRL's RewardConfig names RewardConfig does not take, beside the Trainer's (TRAINING_ARGUMENTS)."""
# by the class name of the settings dataclass the names are refused in
FOREIGN_NAMES = {"TrainingArguments": TRAINING_ARGUMENTS,
                 "DPOConfig": {**TRAINING_ARGUMENTS, **DPO_CONFIG}}
FOREIGN_NAMES["GRPOConfig"] = {**TRAINING_ARGUMENTS, **GRPO_CONFIG}
FOREIGN_NAMES["RewardConfig"] = {**TRAINING_ARGUMENTS, **REWARD_CONFIG}

OPTIMIZERS = {name: f"{_YET}: hputrain trains with AdamW ({', '.join(names.OPTIMIZERS)})" for name in
                  """adamw_hf adamw_torch_xla adamw_torch_npu_fused adamw_apex_fused adafactor
                  adamw_anyprecision adamw_torch_4bit adamw_torch_8bit ademamix sgd adagrad
                  adamw_bnb_8bit adamw_8bit ademamix_8bit lion_8bit lion_32bit paged_adamw_32bit
                  paged_adamw_8bit paged_ademamix_32bit paged_ademamix_8bit paged_lion_32bit
                  paged_lion_8bit rmsprop rmsprop_bnb rmsprop_bnb_8bit rmsprop_bnb_32bit galore_adamw
                  galore_adamw_8bit galore_adafactor galore_adamw_layerwise
                  galore_adamw_8bit_layerwise galore_adafactor_layerwise lomo adalomo grokadamw
                  schedule_free_radam schedule_free_adamw schedule_free_sgd apollo_adamw
                  apollo_adamw_layerwise stable_adamw""".split()}
INTERVAL_STRATEGIES = {  # eval_strategy / save_strategy values
    "best": _BEST,
}
REPORTERS = {name: f"{_YET}: hputrain writes metrics.jsonl and TensorBoard "
                       "(report_to='tensorboard', 'mlflow', 'wandb' or 'none')" for name in
                 """azure_ml clearml codecarbon comet_ml dagshub dvclive flyte neptune swanlab
                 trackio""".split()}

TRAINER_KWARGS = {
    "tokenizer": "is spelled processing_class here (saved beside the model by save_model)",
    "preprocess_logits_for_metrics": f"{_YET}: reduce the logits inside compute_metrics",
    "optimizers": f"{_YET}: the Trainer makes AdamW from args (learning_rate, weight_decay, "
                  "adam_*, optim) and the schedule from lr_scheduler_type and warmup_steps",
    "optimizer_cls_and_kwargs": f"{_YET}: the Trainer makes AdamW from args (learning_rate, "
                                "weight_decay, adam_*, optim)",
    "model_init": "is not supported: pass the model itself, Trainer(model, ...)",
    "compute_loss_func": "is spelled compute_loss here: a function (model, batch) -> loss",
    "gaudi_config": "is spelled accelerator_config here: AcceleratorConfig.from_file(PATH) reads "
                    "GaudiConfig files",
    "peft_config": "is not taken: wrap the model with peft.get_peft_model(model, config) first",
}

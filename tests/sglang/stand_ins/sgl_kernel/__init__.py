"""Test stand-in for the ``sgl_kernel`` CPU ops SGLang imports at module level
(tests/sglang/stand_ins/README.md): each raises if called."""

from _stand_in import StandIn

assign_req_to_token_pool_cpu = StandIn("sgl_kernel.assign_req_to_token_pool_cpu")
copy_all_layer_kv_cache_cpu = StandIn("sgl_kernel.copy_all_layer_kv_cache_cpu")
assign_extend_cache_locs_cpu = StandIn("sgl_kernel.assign_extend_cache_locs_cpu")
fill_accept_out_cache_loc_cpu = StandIn("sgl_kernel.fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = StandIn("sgl_kernel.fill_bonus_tokens_cpu")
build_tree_kernel_efficient_cpu = StandIn("sgl_kernel.build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = StandIn("sgl_kernel.verify_tree_greedy_cpu")

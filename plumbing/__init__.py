"""The plumbing: what keeps a run safe and fast but is not CLIP4IDC. Skip it on a first reading.

The method lives in the files above this folder (clip, encoder, decoder, losses, data, metrics, adapt, caption).
Everything here serves it: a script writes `import plumbing` and calls `plumbing.X`, so every departure from the
lesson says where it goes. Nothing here imports a script, the decoder or METEOR: stage 1 loads neither (synth.py is
imported only when --data synth asks for it).

The map: each part, what it guarantees, and the test of test_all.py that shows it.

  flags.py        A Config dataclass becomes the command line: presets first, then flags; a misspelt flag or a bad
                  value is refused before any work.  test_config_flags_follow_the_dataset_preset_then_the_command_line,
                  test_a_bad_flag_value_is_refused_before_anything_is_read
  files.py        Files written whole or not at all; a full disk or an unwritable folder is one line naming it; one
                  run at a time writes into an --out_dir.  test_a_full_disk_during_a_checkpoint_save_is_one_line_and_
                  keeps_the_last_checkpoint, test_a_second_run_in_a_busy_out_dir_is_refused_in_one_line_naming_the_
                  first_which_finishes_untouched
  progress.py     The one progress meter (the training line with its ETA, a long build's line) and the run's
                  log.jsonl.  test_a_new_run_after_one_stopped_before_its_first_checkpoint_starts_a_fresh_log
  processes.py    One process or one of torchrun's: DDP from the environment, the GPU it takes, autocast and the
                  GradScaler, TF32; one download per machine; processes started by hand wait for a missing one at
                  most CLIP4IDC_PEER_WAIT seconds, and name it.  test_every_launch_form_of_every_script_starts_on_a_gpu_
                  machine_and_takes_its_gpu, test_each_machines_first_process_downloads_while_the_others_wait_then_
                  they_read_it, test_a_process_started_by_hand_names_the_peer_that_never_came_within_its_wait_and_
                  sigterm_ends_the_wait
  batches.py      The global batch over processes and accumulation; one DataLoader per run; an epoch resumed part-way
                  draws what the uninterrupted one drew; its workers' failures are one line naming the fix.
                  test_two_processes_with_b_pairs_each_train_like_one_process_with_2b_pairs, test_a_stage_1_run_
                  killed_at_a_step_and_resumed_writes_the_uninterrupted_runs_files, test_loader_workers_that_die_
                  cannot_start_or_cannot_hand_over_a_batch_end_in_one_line_naming_the_fix
  checkpoints.py  Checkpoints saved atomically on a thread of their own, read without running code and checked by
                  CRC-32; --resume restores model, optimizer, scaler and random state, and refuses other settings
                  or another split; a stage-1 file (ours or a release) and a trained captioner read back.
                  test_a_checkpoint_damaged_inside_a_tensor_is_refused_naming_the_file_and_the_member,
                  test_resume_refuses_a_checkpoint_of_another_model_config
  stopping.py     How a run stops: a diverged loss at the next check, Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 at a step
                  boundary after a save, a damaged image after a save, a user's error as one line, with the command
                  that continues it (torchrun's kept); stdout going away ends nothing.  test_ctrl_c_prints_what_
                  was_saved_and_the_resume_command_and_exits_130, test_a_non_finite_loss_stops_training_at_the_next_
                  check_naming_its_first_step_but_a_skipped_float16_step_does_not, test_stdout_going_away_a_closed_
                  pipe_or_a_full_device_loses_no_step
  loop.py         A run set up and ended (`started`, `Run`, --resume auto) and what the loops do between two
                  optimizer steps (`StepBoundary`: the finiteness check, signals, the progress line and log, saves;
                  an epoch saved before its validation, which a resumed run does first).
                  test_the_step_boundary_reads_the_losses_on_log_and_save_steps_and_saves_between_epochs_or_for_a_
                  signal, test_sigterm_saves_stage_2_at_the_step_boundary_exits_143_and_the_resumed_run_is_the_
                  uninterrupted_one, test_an_image_unreadable_during_validation_saves_the_epoch_first_and_the_
                  resumed_run_is_the_uninterrupted_one
  casts.py        Under bf16 or fp16 autocast the matrix weights cast once a step, in one operator, the same numbers
                  as autocast's casts at each use.  test_casting_the_matrix_weights_once_a_step_gives_autocasts_
                  steps_bit_for_bit_with_fewer_operators
  caches.py       What is computed once and kept on disk, named by what it depends on: the synthetic set (synth.py
                  draws it on first use), preprocessed pixels (the image cache), frozen intra-image tokens, stage 2's
                  pair features; each reserves its disk space first. On a GPU, the training images' cached pixels
                  held in its memory (--resident_pixels).
                  test_the_image_cache_gives_the_decoded_pixels_and_is_rebuilt_when_a_file_changes, test_a_replaced_
                  image_gives_new_pixels_new_intra_tokens_and_new_pair_features, test_a_full_disk_while_the_pair_
                  features_or_the_intra_tokens_are_written_is_one_line_and_leaves_no_file, test_pixels_resident_on_
                  the_device_give_the_batches_of_the_png_files_to_the_byte
  capture.py      A training step captured whole as one CUDA graph and replayed (--cuda_graphs): fixed shapes, the rate
                  a tensor, no host sync; refused in one line off a GPU, with float16 or under DDP.
                  test_a_captured_steps_batches_keep_one_shape_and_its_loss_whatever_the_caption_lengths
  clip_files.py   CLIP's weights and vocabulary: a checksummed download cache, OpenAI's archives read as data, load().
                  test_load_downloads_a_named_model_into_the_cache_once_its_checksum_matches
  release.py      The reference's released files: which stage, its names mapped to ours both ways.
                  test_the_released_captioner_evaluates_and_captions_a_pair_as_its_own_model_does

Below: the names the scripts call, by part.
"""
from plumbing.batches import batch_plan, training_loader
from plumbing.casts import cast_once
from plumbing.caches import (FeatureItems, IntraTokens, ResidentPixels, draw_synthetic, feature_paths, image_reader,
                             resident_pixels)
from plumbing.capture import CapturedStep, check_capture
from plumbing.checkpoints import (Trained, check_resume, checkpoint_tokenizer, load_checkpoint, load_trained,
                                  read_encoder, rng_state, save_checkpoint, split_fingerprint, start_or_resume,
                                  vocabulary_hint, vocabulary_tensor)
from plumbing.clip_files import load as load_clip
from plumbing.clip_files import sha256_of
from plumbing.files import check_out_dir, save_json, size_text
from plumbing.flags import ConfigError, check_image_path, check_length, check_settings, flag, parse_config
from plumbing.loop import Run, StepBoundary, announce, say, started
from plumbing.processes import by_master, dataset_tokenizer, from_master, one_download_per_machine
from plumbing.progress import LOG_NAME, JsonlLog, Progress
from plumbing.release import release_decoder_sizes, rename_reference_decoder_keys
from plumbing.stopping import final_test_stopped, refuse_empty_splits, run_main

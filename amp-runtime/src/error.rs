//! The runtime's error type: one enum, grouped by concern, each message saying what to do.

use candle_core::DType;

/// Errors of the amp runtime. Each message says what to do, and `Debug` prints that message too (see
/// its impl), so that `fn main() -> amp::Result<()>` shows it.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- precisions and policies ----
    /// A precision name that is not one of the accepted spellings.
    #[error("unknown precision `{given}`: expected one of {}", crate::PrecisionSpec::SPELLINGS)]
    UnknownPrecision {
        /// What was given.
        given: String,
    },
    /// `half` where a concrete precision is needed.
    #[error("`half` means the device's best half type and needs a device to resolve; write fp16 or bf16, or resolve it with `PrecisionSpec::resolve`")]
    HalfNeedsDevice,
    /// A dtype that has no mixed-precision meaning.
    #[error("dtype {dtype:?} is not a training precision: amp works with f32, f16 and bf16")]
    UnsupportedDType {
        /// The dtype found.
        dtype: DType,
    },
    /// A policy string that could not be parsed.
    #[error("invalid policy `{policy}`: {reason}")]
    InvalidPolicy {
        /// The whole policy string.
        policy: String,
        /// What is wrong, and where.
        reason: String,
    },
    /// An optimisation level name that is not O0..O3.
    #[error("unknown optimisation level `{given}`: expected O0, O1, O2 or O3")]
    UnknownOptLevel {
        /// What was given.
        given: String,
    },

    // ---- matrix products ----
    /// A GEMM path was forced that this CPU cannot run.
    #[error("GEMM path `{path}` cannot run here: this CPU lacks {features} (see /proc/cpuinfo); use Override::Auto")]
    GemmPathUnsupported {
        /// The path asked for.
        path: amp_kernels::gemm::GemmPath,
        /// The CPU features it needs.
        features: &'static str,
    },

    // ---- checkpoints ----
    /// A checkpoint file could not be read or written (missing, no permission, disk full).
    #[error("checkpoint {}: cannot {action} the file: {source}", path.display())]
    CheckpointIo {
        /// The file.
        path: std::path::PathBuf,
        /// `"read"` or `"write"`.
        action: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint is not a readable safetensors file (damaged, truncated, another format); nothing
    /// was loaded.
    #[error(
        "checkpoint {} refused, the model is unchanged: not a readable safetensors file ({source}); \
         if it was one, it is damaged: resume from an earlier checkpoint or a copy",
        path.display()
    )]
    CheckpointUnreadable {
        /// The file.
        path: std::path::PathBuf,
        /// The parser's finding.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A checkpoint's tensor table, tensor data or training states do not match the checksums amp saved
    /// with them; nothing was loaded.
    #[error(
        "checkpoint {} refused, the model is unchanged: its tensor table, tensor data or training states do \
         not match the checksum saved with them (crc32 {computed}, saved {saved}): the file was damaged \
         after it was written; resume from an earlier checkpoint or a copy",
        path.display()
    )]
    CheckpointDamaged {
        /// The file.
        path: std::path::PathBuf,
        /// The checksum in the file's metadata, as written there.
        saved: String,
        /// The checksum of the data as read.
        computed: String,
    },
    /// The tensors could not be encoded as safetensors; nothing was written.
    #[error("checkpoint {}: cannot encode the tensors as safetensors, nothing written: {source}", path.display())]
    CheckpointEncode {
        /// The file.
        path: std::path::PathBuf,
        /// The encoder's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// Two training states handed to one save or load with the same checkpoint key (one key the other's
    /// folder, `a` and `a/b`, counts too): one would take the other's place.
    #[error(
        "two training states share the checkpoint key `{key}`, so one would be saved or restored as the \
         other; nothing was written or loaded: give each its own name with `.named(..)` (for example \
         `GradScaler::named(\"scaler_d\")`, `FusedAdamW::named(\"adam_d\")`)"
    )]
    CheckpointStateKeys {
        /// The shared key.
        key: String,
    },
    /// A training state was asked for that the checkpoint does not hold; nothing was loaded.
    #[error(
        "checkpoint {} refused, the model is unchanged: it holds no `{key}` state (was it saved with \
         `save_with` and this state?)",
        path.display()
    )]
    CheckpointMissingState {
        /// The file.
        path: std::path::PathBuf,
        /// The state's key (`"scaler"`, `"optimizer"`).
        key: String,
    },
    /// A checkpoint does not match the model; nothing was loaded.
    #[error("checkpoint {} refused, the model is unchanged:{problems}", path.display())]
    CheckpointRefused {
        /// The file.
        path: std::path::PathBuf,
        /// Every mismatch found.
        problems: crate::checkpoint::CheckpointProblems,
    },

    /// A checkpoint's training state (a scaler's, an optimizer's) cannot be restored; nothing was loaded.
    #[error("checkpoint {} refused, the model is unchanged: its `{key}` state: {source}", path.display())]
    CheckpointState {
        /// The file.
        path: std::path::PathBuf,
        /// The state's key (`"scaler"`, `"optimizer"`).
        key: String,
        /// What is wrong with it.
        #[source]
        source: Box<Error>,
    },

    /// `load` was given an export ([`crate::checkpoint::export`]): half-precision weights for inference,
    /// no fp32 masters, no training state; nothing was loaded.
    #[error(
        "{} is an export (each weight in the precision its layer computes in, for inference), not a \
         checkpoint to resume training from; the model is unchanged: load it with \
         `checkpoint::load_export`, or resume from a checkpoint written by `checkpoint::save_with`",
        path.display()
    )]
    CheckpointIsExport {
        /// The file.
        path: std::path::PathBuf,
    },
    /// An export would turn finite weights into infinities (fp16's range ends at 65504); nothing was
    /// written.
    #[error(
        "export {} refused, nothing written: weights beyond the range of the half type their layers \
         compute in would become inf: {overflowing}; compute those layers in bf16 or fp32 \
         (`#[amp(bf16)]` / `#[amp(fp32)]`, or `AmpConfig::with_half(Precision::Bf16)`) and export again",
        path.display()
    )]
    ExportOverflow {
        /// The file.
        path: std::path::PathBuf,
        /// The parameters, how many of their values overflow and in which dtype, as
        /// `` `name` (count in dtype) `` items.
        overflowing: String,
    },

    // ---- models built through a VarBuilder ----
    /// An `AmpVarMap` used in a way that would let the model's tensors and the trained values part.
    #[error("AmpVarMap: {reason}")]
    InvalidVarMapUse {
        /// What was asked, and why it cannot be done.
        reason: String,
    },
    /// `amp::initialize` asked to convert a parameter whose dtype a candle model already holds.
    #[error(
        "`{path}` is stored as {from:?} inside a model built through amp's VarBuilder and cannot become \
         {to:?}: build the model again from an `AmpVarMap` of the wanted level"
    )]
    StorageFixed {
        /// The parameter.
        path: String,
        /// Its storage.
        from: crate::ParamStorage,
        /// The storage asked for.
        to: crate::ParamStorage,
    },
    /// Two layers share one parameter (tied weights) but their precisions ask for different storage.
    #[error(
        "`{path}` is the same variable as `{tied_to}` (tied weights), but its layer asks for {storage:?} \
         where `{tied_to}`'s asks for {tied_storage:?}: give both layers the same precision (the same \
         `#[amp(...)]`), or give them variables of their own"
    )]
    TiedStorageDiffers {
        /// The parameter met second.
        path: String,
        /// The path it was met at first.
        tied_to: String,
        /// The storage its layer asks for.
        storage: crate::ParamStorage,
        /// The storage the first layer gave it.
        tied_storage: crate::ParamStorage,
    },

    // ---- loss scaling ----
    /// A micro-batch accumulated, or a window stepped, after the scaler stepped or was restored since
    /// the window's first micro-batch.
    #[error(
        "a gradient accumulation window was interrupted: its scaler took {steps} step(s) since the window's \
         first micro-batch (loss scale {from} -> {to}), so its micro-batches saw different weights or scales. \
         Step each window (`step_fused_accumulated`) before any other step of its scaler"
    )]
    AccumulationInterrupted {
        /// Steps of the scaler inside the window (0 when it was restored to another state).
        steps: u64,
        /// The scale of the window's first micro-batch.
        from: f32,
        /// The scaler's scale now.
        to: f32,
    },
    /// An accumulated step whose optimizer updates a parameter that no model given to `accumulate` in
    /// the window holds.
    #[error(
        "`{path}` is updated by the optimizer, but no model given to `GradScaler::accumulate` in this window \
         holds it, so its gradients were not summed: pass `accumulate` the model that holds every parameter \
         the optimizer updates"
    )]
    NotAccumulated {
        /// The parameter.
        path: String,
    },
    /// A step from a gradient accumulator that holds no micro-batch.
    #[error(
        "the gradient accumulator is empty: call `GradScaler::accumulate` for each micro-batch before the \
         window's step (the step empties it)"
    )]
    NothingAccumulated,
    /// A scaler setting out of range.
    #[error("invalid loss-scaler setting: {reason}")]
    InvalidScalerConfig {
        /// Which setting, and its valid range.
        reason: String,
    },
    /// An overflow at the minimum scale with `AtScaleFloor::Stop`.
    #[error(
        "step {step}: non-finite values at the minimum loss scale {scale} ({what}); no scale can fix this: \
         look for a diverged model (lower the learning rate), a log/division of zero, or bad data. \
         Set `at_floor: AtScaleFloor::Continue` to keep skipping instead"
    )]
    ScaleAtFloor {
        /// Steps taken.
        step: u64,
        /// The floor.
        scale: f32,
        /// What was not finite.
        what: String,
    },

    /// [`crate::scaler::step_unscaled`] on a model that computes in fp16 because its opt level's half
    /// is fp16 (an attribute's fp16 is refused at compile time).
    #[error(
        "`{path}` computes in fp16 (its opt level's half type), so this model must be trained with a \
         loss scaler, or small gradients underflow: use `GradScaler::for_model(&model, \
         ScalerConfig::default())` and its `step` or `step_fused` instead of `step_unscaled`, or \
         initialize with bf16 as the half type; nothing was changed"
    )]
    NeedsLossScaler {
        /// The first layer computing in fp16.
        path: String,
    },

    /// A scaler that [`GradScaler::for_model`](crate::GradScaler::for_model) disabled, because the
    /// model computed in no fp16 then, stepping a model that does: it was initialized afterwards.
    #[error(
        "the model computes in fp16 ({found}), but this loss scaler was built by `GradScaler::for_model` \
         when it did not (before `amp::initialize`), so it is disabled and small fp16 gradients would \
         flush to zero unscaled; nothing was changed. Build the scaler after `amp::initialize`, or with \
         `GradScaler::new(ScalerConfig::default())`"
    )]
    ScalerBuiltBeforeFp16 {
        /// Where fp16 was found.
        found: String,
    },

    /// A loss that is not one value.
    #[error(
        "the loss must be one value (shape [] or [1]) to take gradients of, but has shape {shape:?}: \
         reduce it first, e.g. with `.mean_all()` (backward would otherwise differentiate the sum of its \
         elements); nothing was changed"
    )]
    LossNotScalar {
        /// The loss's shape.
        shape: Vec<usize>,
    },

    /// A scaled fp16 gradient with no fp32 master to unscale it into (an O3 fp16 parameter).
    #[error(
        "`{path}` has an fp16 gradient and no fp32 master: unscaling it by 1/{scale} in fp16 would flush \
         its small values to zero (PyTorch refuses this too); nothing was changed. Initialize the model \
         with O2 (fp32 masters), or train O3 with a scale of 1 (`GradScaler::new(ScalerConfig::fixed(1.0))`, \
         Apex O3's default)"
    )]
    Fp16Unscale {
        /// The parameter.
        path: String,
        /// The loss scale.
        scale: f32,
    },

    /// A gradient the last [`GradScaler::unscale`](crate::scaler::GradScaler::unscale) divided, before
    /// the scaler's `update`.
    #[error(
        "the gradient of `{path}` was unscaled already since the scaler's last `update`: unscaling it \
         again would divide it by the scale twice; nothing was divided. Unscale each backward pass's \
         gradients once (clip between `unscale` and the optimizer), then call `update`; or let \
         `GradScaler::step` do both"
    )]
    AlreadyUnscaled {
        /// The first parameter (in model order) whose gradient was unscaled already.
        path: String,
    },

    /// Trainable parameters that received no gradient on the first step (see
    /// [`MissingGradients`](crate::scaler::MissingGradients)); nothing was changed.
    #[error(
        "{} trainable parameter(s) received no gradient on the first step, so training would never change \
         them; nothing was changed:{params}\n  if they are frozen on purpose, build the scaler with \
         `.on_missing_gradients(MissingGradients::Warn)`",
        params.0.len()
    )]
    NoGradient {
        /// Each parameter with its likely cause.
        params: crate::scaler::NoGradients,
    },

    /// A parameter whose gradient candle's store holds twice: once for the half working copy, once for
    /// the fp32 master.
    #[error(
        "`{path}` has two gradients: one through its half working copy and one through its fp32 master \
         (amp's CPU GEMM reads the master, another op read the working copy); amp's own steps add them: \
         call `amp::grads_to_masters(&model, &mut grads)` before handing the store to an optimizer, use \
         `GradScaler::step_fused`, or give the parameter `GradientRoute::Working`"
    )]
    SplitGradient {
        /// The parameter.
        path: String,
    },

    // ---- optimizers ----
    /// A parameter without an fp32 copy handed to an optimizer that keeps fp32 masters.
    #[error(
        "`{path}` is stored in {precision} with no fp32 master; amp's optimizers update fp32 masters: \
         initialize the model with O2 (fp32 masters + half working copies) instead of O3, or pass f32 variables"
    )]
    NoFp32Master {
        /// The parameter.
        path: String,
        /// Its storage precision.
        precision: crate::Precision,
    },
    /// An optimizer whose parameters the model converted after the optimizer took them (built before
    /// `amp::initialize`, or kept across another `initialize`): its steps would update variables that
    /// forward no longer reads.
    #[error(
        "`{path}` was converted (by `amp::initialize` or `Param::set_storage`) after this optimizer took \
         its variables, so its steps would train copies the model no longer reads; nothing was changed. \
         Build the optimizer after `amp::initialize` (`ParamGroups::from_model(&model)`, then the \
         optimizer), and again after initializing the model anew"
    )]
    StaleParams {
        /// The first parameter found converted.
        path: String,
    },
    /// Optimizer saved state that does not fit the optimizer it is loaded into.
    #[error("optimizer: {reason}")]
    OptimizerState {
        /// What is wrong.
        reason: String,
    },
    /// Optimizer settings out of range, or that cannot be used together.
    #[error("invalid optimizer setting: {reason}")]
    InvalidOptimizerConfig {
        /// Which settings, and what would be valid.
        reason: String,
    },
    /// The JSON part of a saved training state (a scaler's, an optimizer's) could not be read. The
    /// message names the parser's finding too (`missing field ...`), so that the one line a user sees
    /// says what is wrong; the parser's error is also the source.
    #[error(
        "the saved `{key}` state in the checkpoint is unreadable (written by another version, or damaged): \
         {source}"
    )]
    SavedStateUnreadable {
        /// The state's key in the checkpoint.
        key: String,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },

    // ---- data-parallel training ----
    /// The ranks of a data-parallel step hold gradients for different parameters: their buckets would
    /// sum one parameter's values into another's, and the replicas would step different parameters.
    #[error(
        "rank {rank}: the ranks hold gradients for different parameters this step (this rank has {count}); \
         nothing was changed. A parameter that some rank's batch did not reach (a data-dependent \
         branch, an expert no token was routed to) has no gradient there: give it one on every rank \
         (add 0 times its output to the loss), freeze it on every rank, or use `Zero1`, which counts a \
         missing gradient as zeros"
    )]
    GradientsDiffer {
        /// This rank.
        rank: usize,
        /// How many gradients this rank holds.
        count: usize,
    },
    /// An MPI entry point in a build without the `mpi` feature.
    #[error(
        "amp was built without MPI: enable the `mpi` feature of `amp` (it needs an MPI library with `mpicc`, \
         e.g. Debian's libopenmpi-dev and openmpi-bin, and libclang-dev), or train on one process with \
         `SingleProcess`"
    )]
    MpiNotBuilt,
    /// MPI could not be initialized.
    #[error("MPI: {reason}")]
    MpiInit {
        /// What went wrong, and what to do.
        reason: String,
    },
    /// An NCCL entry point in a build without the `nccl` feature.
    #[error(
        "amp was built without NCCL: enable the `nccl` feature of `amp` (it implies `cuda`; libnccl comes \
         with NVIDIA's wheel `nvidia-nccl-cu13` or the CUDA toolkit's NCCL package), or all-reduce over MPI \
         with the model on the CPU"
    )]
    NcclNotBuilt,
    /// NCCL failed: the library, a communicator that could not be created, a collective.
    #[error("NCCL: {reason}")]
    Nccl {
        /// What failed, and what to do.
        reason: String,
    },
    /// CUDA tensors handed to a communicator whose engine moves host memory only.
    #[error(
        "{engine} moves host memory and these tensors are on a CUDA device: create an `amp::distributed::Nccl` \
         communicator for them (feature `nccl`, bootstrapped over this one: `Nccl::new(&mpi, &device)`), \
         or keep the model on the CPU"
    )]
    HostCollectivesOnly {
        /// The communicator (its `Debug` form).
        engine: String,
    },
    /// A collective called with buffers or a root that cannot be valid in this group; nothing was sent.
    #[error("{collective}: {reason}")]
    CollectiveShape {
        /// The collective.
        collective: &'static str,
        /// What does not fit, and what would.
        reason: String,
    },
    /// The ranks of a data-parallel group hold different models (parameter names, shapes or counts), so
    /// their gradients cannot be summed; every rank returns this error, nothing was changed.
    #[error(
        "data-parallel ranks hold different models: rank {rank}'s parameters differ from rank 0's ({reason}); \
         start every rank from the same program, model definition and configuration"
    )]
    ReplicasDiffer {
        /// The lowest rank whose parameters differ from rank 0's.
        rank: usize,
        /// What this rank knows of the difference.
        reason: String,
    },
    /// A data-parallel setting out of range.
    #[error("invalid data-parallel setting: {reason}")]
    InvalidDataParallelConfig {
        /// Which setting, and its valid range.
        reason: String,
    },
    /// A ZeRO-1 step or checkpoint given an optimizer that does not hold exactly this rank's shard, or
    /// ranks whose shards disagree.
    #[error("ZeRO-1: {reason}")]
    ZeroShard {
        /// What does not match, and what to do.
        reason: String,
    },

    // ---- memory access ----
    /// A kernel needs contiguous memory.
    #[error(
        "amp's fused kernels need contiguous tensors; call `.contiguous()` on this gradient or parameter"
    )]
    NotContiguous,
    /// A kernel that has no implementation on this device.
    #[error("{what} has no implementation on {device} yet; keep its tensors on the CPU")]
    DeviceNotSupported {
        /// What was asked.
        what: String,
        /// The tensor's device.
        device: String,
    },
    /// A step asked to run without waiting for the device that cannot.
    #[error("{what} cannot run as a deferred step: call `GradScaler::step_fused` instead (it waits once per step)")]
    NotDeferrable {
        /// What was asked.
        what: String,
    },
    /// Steps queued on a device whose outcome the host has not read yet, met by a call that needs it.
    #[error("{steps} deferred step(s) are still on the device: call `GradScaler::settle` before `{call}`")]
    Unsettled {
        /// Deferred steps not yet settled.
        steps: u64,
        /// The call that needs the settled state.
        call: &'static str,
    },
    /// A CUDA entry point in a build without the `cuda` feature.
    #[error(
        "amp was built without CUDA: enable the `cuda` feature of `amp` (it needs the CUDA toolkit's nvcc to \
         build candle's kernels; scripts/cuda-toolchain.sh installs one from PyPI wheels), or train on the CPU"
    )]
    CudaNotBuilt,
    /// A CUDA operation failed: no device, a kernel that did not compile (with NVRTC's log), the driver.
    #[error("CUDA: {reason}")]
    Cuda {
        /// What failed.
        reason: String,
    },
    /// A broken invariant inside amp: a bug, please report it.
    #[error("internal error in amp (please report): {what}")]
    Internal {
        /// What broke.
        what: String,
    },

    // ---- tensors ----
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// The backward pass met an op of the forward pass that candle cannot differentiate, for which
    /// amp has one that it can.
    #[error("the backward pass failed: {candle}; amp's {instead} computes it with a backward")]
    NoBackward {
        /// candle's error.
        candle: candle_core::Error,
        /// amp's replacement, and what it takes.
        instead: &'static str,
    },

    // ---- ops refused in half precision ----
    /// `binary_cross_entropy` on probabilities stored in half precision (Apex and autocast ban it too).
    #[error(
        "binary_cross_entropy on a {precision} input is unsafe in half precision (log of probabilities near \
         0 and 1 underflows); pass logits to binary_cross_entropy_with_logits instead"
    )]
    BinaryCrossEntropyInHalf {
        /// The half precision of the probabilities that were passed.
        precision: crate::Precision,
    },
}

/// The runtime's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The message ([`Display`](std::fmt::Display)), then each source whose words it does not already
/// hold, a line each. An error returned from `main` is printed with `Debug` (std's `Termination`), as is
/// one in a `Box<dyn Error>` or an `unwrap`: with a derived `Debug` a user would read the variant's
/// fields (`GemmPathUnsupported { path: Avx512, features: "avx512f" }`) where the message says what to
/// do (`... use Override::Auto`).
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let message = self.to_string();
        f.write_str(&message)?;
        let mut source = std::error::Error::source(self);
        while let Some(cause) = source {
            let words = cause.to_string();
            if !message.contains(&words) {
                write!(f, "\ncaused by: {words}")?;
            }
            source = cause.source();
        }
        Ok(())
    }
}

impl From<Error> for candle_core::Error {
    fn from(err: Error) -> Self {
        match err {
            Error::Candle(inner) => inner,
            other => candle_core::Error::wrap(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Error;

    #[test]
    fn debug_prints_the_message_that_says_what_to_do() {
        let err =
            Error::GemmPathUnsupported { path: amp_kernels::gemm::GemmPath::Avx512, features: "avx512f" };
        assert_eq!(format!("{err:?}"), err.to_string());
        assert!(format!("{err:?}").ends_with("use Override::Auto"), "{err:?}");
    }

    #[test]
    fn debug_adds_the_sources_the_message_does_not_hold() {
        // The io error is in the message already: not repeated.
        let source = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let err = Error::CheckpointIo { path: "ckpt.safetensors".into(), action: "read", source };
        assert_eq!(format!("{err:?}"), "checkpoint ckpt.safetensors: cannot read the file: no such file");
        // A cause below the source that the message does not hold: a line of its own.
        let source = std::io::Error::other(Mount(std::io::Error::other("the volume went away")));
        let err = Error::CheckpointIo { path: "ckpt.safetensors".into(), action: "write", source };
        assert_eq!(
            format!("{err:?}"),
            "checkpoint ckpt.safetensors: cannot write the file: the mount failed\ncaused by: the volume went away"
        );
    }

    /// An error with a source of its own, which its message leaves out.
    #[derive(Debug)]
    struct Mount(std::io::Error);

    impl std::fmt::Display for Mount {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("the mount failed")
        }
    }

    impl std::error::Error for Mount {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}

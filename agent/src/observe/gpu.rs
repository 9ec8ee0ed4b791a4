//! `gpu`: the node's NVIDIA GPUs, read through NVML (`nvml-wrapper`, which
//! loads `libnvidia-ml` at run time, so the agent builds and runs without
//! CUDA or a driver).
//!
//! Without a driver the agent says so once and reports no GPUs, with the
//! reason; nothing else changes. This module only reads: it never changes a
//! GPU setting. The mapping from NVML's figures (mW, KB/s, KiB) to metrics
//! goes through the [`GpuDevice`] trait so it is tested with a fake device.

use std::ffi::OsStr;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::{SampleValue, UsedGpuMemory};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use serde::Serialize;

/// NVML field: total NVLink data sent, in KiB (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX).
const FIELD_NVLINK_DATA_TX_KIB: u32 = 138;
/// NVML field: total NVLink data received, in KiB (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX).
const FIELD_NVLINK_DATA_RX_KIB: u32 = 139;

/// What the agent needs from one GPU, in NVML's own units. Implemented for
/// NVML's device and, in tests, by a fake.
pub trait GpuDevice {
    /// NVML's index of the device.
    fn index(&self) -> Result<u32, NvmlError>;
    /// Product name.
    fn name(&self) -> Result<String, NvmlError>;
    /// Stable identifier (`GPU-…`).
    fn uuid(&self) -> Result<String, NvmlError>;
    /// (GPU busy %, memory busy %) over NVML's last sample period.
    fn utilization_percent(&self) -> Result<(u32, u32), NvmlError>;
    /// (used, total) device memory in bytes.
    fn memory_bytes(&self) -> Result<(u64, u64), NvmlError>;
    /// Board power draw in milliwatts.
    fn power_milliwatts(&self) -> Result<u32, NvmlError>;
    /// Die temperature in °C.
    fn temperature_celsius(&self) -> Result<u32, NvmlError>;
    /// Current clock of a domain in MHz.
    fn clock_mhz(&self, clock: Clock) -> Result<u32, NvmlError>;
    /// PCIe throughput in one direction, in KB/s (NVML's unit, 1 KB = 1024 bytes).
    fn pcie_kilobytes_per_second(&self, counter: PcieUtilCounter) -> Result<u32, NvmlError>;
    /// NVLink data (sent, received) since the driver loaded, in KiB.
    fn nvlink_kibibytes_total(&self) -> Result<(u64, u64), NvmlError>;
    /// Compute processes on the device: (pid, used device memory in bytes).
    fn compute_processes(&self) -> Result<Vec<(u32, Option<u64>)>, NvmlError>;
}

/// One process using a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuProcess {
    /// Its pid (in the host's pid namespace).
    pub pid: u32,
    /// Device memory it uses, when the driver says.
    pub used_memory_bytes: Option<u64>,
}

/// One GPU's figures at one moment, in metric units. A figure the device
/// does not support is `None`; one that failed otherwise is named in
/// `unavailable` with the reason.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuReading {
    /// NVML's index.
    pub index: u32,
    /// Product name.
    pub name: Option<String>,
    /// `GPU-…` identifier.
    pub uuid: Option<String>,
    /// % of time a kernel was running.
    pub utilization_gpu_percent: Option<u32>,
    /// % of time device memory was read or written.
    pub utilization_memory_percent: Option<u32>,
    /// Device memory in use.
    pub memory_used_bytes: Option<u64>,
    /// Device memory installed.
    pub memory_total_bytes: Option<u64>,
    /// Board power draw.
    pub power_watts: Option<f64>,
    /// Die temperature.
    pub temperature_celsius: Option<u32>,
    /// SM clock.
    pub clock_sm_mhz: Option<u32>,
    /// Memory clock.
    pub clock_memory_mhz: Option<u32>,
    /// Graphics clock.
    pub clock_graphics_mhz: Option<u32>,
    /// PCIe bytes/s sent by the device.
    pub pcie_tx_bytes_per_second: Option<u64>,
    /// PCIe bytes/s received by the device.
    pub pcie_rx_bytes_per_second: Option<u64>,
    /// NVLink bytes sent since the driver loaded (a counter).
    pub nvlink_tx_bytes_total: Option<u64>,
    /// NVLink bytes received since the driver loaded (a counter).
    pub nvlink_rx_bytes_total: Option<u64>,
    /// Compute processes on the device.
    pub processes: Vec<GpuProcess>,
    /// Figures that failed for another reason than "not supported": `field: error`.
    pub unavailable: Vec<String>,
}

/// Reads every figure of one device; never fails as a whole.
pub fn read_device(device: &dyn GpuDevice, fallback_index: u32) -> GpuReading {
    let mut unavailable = Vec::new();
    let mut figures = Taker(&mut unavailable);
    let index = figures
        .take("index", device.index())
        .unwrap_or(fallback_index);
    let name = figures.take("name", device.name());
    let uuid = figures.take("uuid", device.uuid());
    let utilization = figures.take("utilization", device.utilization_percent());
    let memory = figures.take("memory", device.memory_bytes());
    let power = figures.take("power", device.power_milliwatts());
    let temperature = figures.take("temperature", device.temperature_celsius());
    let clock_sm = figures.take("clock_sm", device.clock_mhz(Clock::SM));
    let clock_memory = figures.take("clock_memory", device.clock_mhz(Clock::Memory));
    let clock_graphics = figures.take("clock_graphics", device.clock_mhz(Clock::Graphics));
    let pcie_tx = figures.take(
        "pcie_tx",
        device.pcie_kilobytes_per_second(PcieUtilCounter::Send),
    );
    let pcie_rx = figures.take(
        "pcie_rx",
        device.pcie_kilobytes_per_second(PcieUtilCounter::Receive),
    );
    let nvlink = figures.take("nvlink", device.nvlink_kibibytes_total());
    let processes = figures
        .take("processes", device.compute_processes())
        .unwrap_or_default();
    GpuReading {
        index,
        name,
        uuid,
        utilization_gpu_percent: utilization.map(|(gpu, _)| gpu),
        utilization_memory_percent: utilization.map(|(_, memory)| memory),
        memory_used_bytes: memory.map(|(used, _)| used),
        memory_total_bytes: memory.map(|(_, total)| total),
        power_watts: power.map(|milliwatts| f64::from(milliwatts) / 1000.0),
        temperature_celsius: temperature,
        clock_sm_mhz: clock_sm,
        clock_memory_mhz: clock_memory,
        clock_graphics_mhz: clock_graphics,
        pcie_tx_bytes_per_second: pcie_tx.map(|kb| u64::from(kb) * 1024),
        pcie_rx_bytes_per_second: pcie_rx.map(|kb| u64::from(kb) * 1024),
        nvlink_tx_bytes_total: nvlink.map(|(tx, _)| tx.saturating_mul(1024)),
        nvlink_rx_bytes_total: nvlink.map(|(_, rx)| rx.saturating_mul(1024)),
        processes: processes
            .into_iter()
            .map(|(pid, used_memory_bytes)| GpuProcess {
                pid,
                used_memory_bytes,
            })
            .collect(),
        unavailable,
    }
}

/// Keeps a figure, drops "not supported" silently, and names other failures.
struct Taker<'a>(&'a mut Vec<String>);

impl Taker<'_> {
    fn take<T>(&mut self, field: &str, result: Result<T, NvmlError>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(NvmlError::NotSupported) => None,
            Err(error) => {
                self.0.push(format!("{field}: {error}"));
                None
            }
        }
    }
}

/// The GPUs of this node as the API reports them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuSnapshot {
    /// One reading per GPU; empty without a driver.
    pub gpus: Vec<GpuReading>,
    /// Why there are no readings, when NVML is not usable here.
    pub unavailable_reason: Option<String>,
}

/// NVML, if this node has it.
pub struct Gpus {
    nvml: Result<Nvml, String>,
}

impl Gpus {
    /// Loads NVML. Without a driver, logs one line and keeps the reason.
    pub fn init() -> Self {
        // Containers often get only the versioned name mounted in.
        let nvml = Nvml::builder()
            .lib_path(OsStr::new("libnvidia-ml.so.1"))
            .init()
            .or_else(|_| Nvml::init())
            .map_err(|error| explain(&error));
        match &nvml {
            Ok(nvml) => {
                let count = nvml.device_count().unwrap_or(0);
                tracing::info!(gpus = count, "NVML loaded");
            }
            Err(reason) => tracing::info!("no GPU metrics: {reason}"),
        }
        Self { nvml }
    }

    /// Reads every GPU now.
    pub fn snapshot(&self) -> GpuSnapshot {
        let nvml = match &self.nvml {
            Ok(nvml) => nvml,
            Err(reason) => {
                return GpuSnapshot {
                    gpus: Vec::new(),
                    unavailable_reason: Some(reason.clone()),
                };
            }
        };
        let count = match nvml.device_count() {
            Ok(count) => count,
            Err(error) => {
                return GpuSnapshot {
                    gpus: Vec::new(),
                    unavailable_reason: Some(format!("NVML could not count the GPUs: {error}")),
                };
            }
        };
        let mut gpus = Vec::new();
        let mut failures = Vec::new();
        for index in 0..count {
            match nvml.device_by_index(index) {
                Ok(device) => gpus.push(read_device(&NvmlDevice(device), index)),
                Err(error) => failures.push(format!("GPU {index}: {error}")),
            }
        }
        GpuSnapshot {
            gpus,
            unavailable_reason: (!failures.is_empty()).then(|| failures.join("; ")),
        }
    }
}

/// The pids of the compute processes on `devices`, sorted, each once. A
/// device whose list fails is skipped (logged at debug: NVML is asked once
/// a second).
pub fn compute_pids<'a>(devices: impl IntoIterator<Item = &'a dyn GpuDevice>) -> Vec<u32> {
    let mut pids = Vec::new();
    for device in devices {
        match device.compute_processes() {
            Ok(processes) => pids.extend(processes.into_iter().map(|(pid, _)| pid)),
            Err(error) => tracing::debug!(%error, "a GPU's compute processes could not be read"),
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

impl Gpus {
    /// The node's GPUs, loaded once per agent process and shared (by the
    /// API and by the discovery of GPU compute processes).
    pub fn shared() -> std::sync::Arc<Gpus> {
        static SHARED: std::sync::OnceLock<std::sync::Arc<Gpus>> = std::sync::OnceLock::new();
        SHARED
            .get_or_init(|| std::sync::Arc::new(Gpus::init()))
            .clone()
    }
}

impl crate::discovery::GpuProcessLister for Gpus {
    fn compute_pids(&self) -> Vec<u32> {
        let Ok(nvml) = &self.nvml else {
            return Vec::new();
        };
        let count = nvml.device_count().unwrap_or(0);
        let devices: Vec<NvmlDevice<'_>> = (0..count)
            .filter_map(|index| nvml.device_by_index(index).ok().map(NvmlDevice))
            .collect();
        compute_pids(devices.iter().map(|d| d as &dyn GpuDevice))
    }
}

/// A person-readable reason why NVML is not usable.
fn explain(error: &NvmlError) -> String {
    match error {
        NvmlError::LibloadingError(inner) => format!(
            "libnvidia-ml.so could not be loaded ({inner}): no NVIDIA driver is installed on this node, or it is not mounted into this container"
        ),
        NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".to_owned(),
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".to_owned(),
        other => format!("NVML failed to initialize: {other}"),
    }
}

/// NVML's device behind [`GpuDevice`].
struct NvmlDevice<'nvml>(nvml_wrapper::Device<'nvml>);

impl GpuDevice for NvmlDevice<'_> {
    fn index(&self) -> Result<u32, NvmlError> {
        self.0.index()
    }
    fn name(&self) -> Result<String, NvmlError> {
        self.0.name()
    }
    fn uuid(&self) -> Result<String, NvmlError> {
        self.0.uuid()
    }
    fn utilization_percent(&self) -> Result<(u32, u32), NvmlError> {
        self.0.utilization_rates().map(|u| (u.gpu, u.memory))
    }
    fn memory_bytes(&self) -> Result<(u64, u64), NvmlError> {
        self.0.memory_info().map(|m| (m.used, m.total))
    }
    fn power_milliwatts(&self) -> Result<u32, NvmlError> {
        self.0.power_usage()
    }
    fn temperature_celsius(&self) -> Result<u32, NvmlError> {
        self.0.temperature(TemperatureSensor::Gpu)
    }
    fn clock_mhz(&self, clock: Clock) -> Result<u32, NvmlError> {
        self.0.clock_info(clock)
    }
    fn pcie_kilobytes_per_second(&self, counter: PcieUtilCounter) -> Result<u32, NvmlError> {
        self.0.pcie_throughput(counter)
    }
    fn nvlink_kibibytes_total(&self) -> Result<(u64, u64), NvmlError> {
        let fields = [
            FieldId(FIELD_NVLINK_DATA_TX_KIB),
            FieldId(FIELD_NVLINK_DATA_RX_KIB),
        ];
        let samples = self.0.field_values_for(&fields)?;
        let mut values = [0u64; 2];
        for (slot, sample) in values.iter_mut().zip(samples) {
            *slot = match sample?.value? {
                SampleValue::U64(v) => v,
                SampleValue::U32(v) => u64::from(v),
                SampleValue::I64(v) => u64::try_from(v).unwrap_or(0),
                SampleValue::F64(v) => v.max(0.0) as u64,
            };
        }
        Ok((values[0], values[1]))
    }
    fn compute_processes(&self) -> Result<Vec<(u32, Option<u64>)>, NvmlError> {
        Ok(self
            .0
            .running_compute_processes()?
            .into_iter()
            .map(|p| {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, used)
            })
            .collect())
    }
}

/// A GPU whose figures a test sets, for every module's tests.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    /// A device whose figures the test sets; `None` means "not supported".
    #[derive(Default)]
    pub struct FakeDevice {
        /// Board power in mW (`None`: not supported).
        pub power_mw: Option<u32>,
        /// PCIe (tx, rx) in KB/s (`None`: not supported).
        pub pcie_kb: Option<(u32, u32)>,
        /// NVLink (tx, rx) totals in KiB (`None`: not supported).
        pub nvlink_kib: Option<(u64, u64)>,
        /// The temperature read fails (GPU lost).
        pub temperature_fails: bool,
        /// Compute processes; `None`: the default two (4242, 4243).
        pub processes: Option<Vec<(u32, Option<u64>)>>,
        /// The process list fails (as on a GPU that fell off the bus).
        pub processes_fail: bool,
    }

    fn supported<T>(value: Option<T>) -> Result<T, NvmlError> {
        value.ok_or(NvmlError::NotSupported)
    }

    impl GpuDevice for FakeDevice {
        fn index(&self) -> Result<u32, NvmlError> {
            Ok(3)
        }
        fn name(&self) -> Result<String, NvmlError> {
            Ok("Fake H100".into())
        }
        fn uuid(&self) -> Result<String, NvmlError> {
            Ok("GPU-fake".into())
        }
        fn utilization_percent(&self) -> Result<(u32, u32), NvmlError> {
            Ok((87, 41))
        }
        fn memory_bytes(&self) -> Result<(u64, u64), NvmlError> {
            Ok((10 << 30, 80 << 30))
        }
        fn power_milliwatts(&self) -> Result<u32, NvmlError> {
            supported(self.power_mw)
        }
        fn temperature_celsius(&self) -> Result<u32, NvmlError> {
            if self.temperature_fails {
                Err(NvmlError::GpuLost)
            } else {
                Ok(64)
            }
        }
        fn clock_mhz(&self, clock: Clock) -> Result<u32, NvmlError> {
            Ok(match clock {
                Clock::SM => 1980,
                Clock::Memory => 2619,
                _ => 1755,
            })
        }
        fn pcie_kilobytes_per_second(&self, counter: PcieUtilCounter) -> Result<u32, NvmlError> {
            supported(self.pcie_kb.map(|(tx, rx)| match counter {
                PcieUtilCounter::Send => tx,
                PcieUtilCounter::Receive => rx,
            }))
        }
        fn nvlink_kibibytes_total(&self) -> Result<(u64, u64), NvmlError> {
            supported(self.nvlink_kib)
        }
        fn compute_processes(&self) -> Result<Vec<(u32, Option<u64>)>, NvmlError> {
            if self.processes_fail {
                return Err(NvmlError::GpuLost);
            }
            Ok(self
                .processes
                .clone()
                .unwrap_or_else(|| vec![(4242, Some(1 << 30)), (4243, None)]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeDevice;
    use super::*;
    use crate::discovery::{GpuProcessLister, PidSource};

    /// Two fake GPUs and one whose process list fails.
    struct FakeGpus(Vec<FakeDevice>);

    impl GpuProcessLister for FakeGpus {
        fn compute_pids(&self) -> Vec<u32> {
            compute_pids(self.0.iter().map(|d| d as &dyn GpuDevice))
        }
    }

    #[test]
    fn gpu_compute_processes_are_a_pid_source() {
        use FakeDevice;
        let me = std::process::id();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let other = child.id();
        let gpus = FakeGpus(vec![
            FakeDevice {
                processes: Some(vec![(other, Some(1 << 30)), (me, None)]),
                ..FakeDevice::default()
            },
            // A pid on two GPUs is listed once; a pid that is not (or no
            // longer) a process here is not watched.
            FakeDevice {
                processes: Some(vec![(me, Some(1 << 20)), (99_999_999, None)]),
                ..FakeDevice::default()
            },
            FakeDevice {
                processes_fail: true,
                ..FakeDevice::default()
            },
        ]);
        let mut expected = vec![me, other];
        expected.sort_unstable();
        let mut with_ghost = expected.clone();
        with_ghost.push(99_999_999);
        assert_eq!(gpus.compute_pids(), with_ghost);
        let mut source = crate::discovery::GpuPids(std::sync::Arc::new(gpus));
        assert_eq!(source.pids(), expected);
        let mut discovery = crate::discovery::Discovery::default();
        discovery.add(Box::new(source));
        assert_eq!(discovery.scan().into_iter().collect::<Vec<_>>(), expected);
        let _ = child.kill();
        let _ = child.wait();
        // Once the process has gone it is not asked for any more.
        let crate::discovery::GpuPids(lister) =
            crate::discovery::GpuPids(std::sync::Arc::new(FakeGpus(vec![FakeDevice {
                processes: Some(vec![(other, None)]),
                ..FakeDevice::default()
            }])));
        assert!(crate::discovery::GpuPids(lister).pids().is_empty());
    }

    #[test]
    fn maps_nvml_units_to_metric_units() {
        let device = FakeDevice {
            power_mw: Some(312_500),
            pcie_kb: Some((2_000, 3)),
            nvlink_kib: Some((5, 7)),
            ..FakeDevice::default()
        };
        let reading = read_device(&device, 0);
        assert_eq!(reading.index, 3);
        assert_eq!(reading.name.as_deref(), Some("Fake H100"));
        assert_eq!(reading.utilization_gpu_percent, Some(87));
        assert_eq!(reading.utilization_memory_percent, Some(41));
        assert_eq!(reading.memory_used_bytes, Some(10 << 30));
        assert_eq!(reading.memory_total_bytes, Some(80 << 30));
        assert_eq!(reading.power_watts, Some(312.5));
        assert_eq!(reading.temperature_celsius, Some(64));
        assert_eq!(
            (
                reading.clock_sm_mhz,
                reading.clock_memory_mhz,
                reading.clock_graphics_mhz
            ),
            (Some(1980), Some(2619), Some(1755))
        );
        assert_eq!(reading.pcie_tx_bytes_per_second, Some(2_048_000));
        assert_eq!(reading.pcie_rx_bytes_per_second, Some(3_072));
        assert_eq!(reading.nvlink_tx_bytes_total, Some(5 * 1024));
        assert_eq!(reading.nvlink_rx_bytes_total, Some(7 * 1024));
        assert_eq!(
            reading.processes,
            vec![
                GpuProcess {
                    pid: 4242,
                    used_memory_bytes: Some(1 << 30)
                },
                GpuProcess {
                    pid: 4243,
                    used_memory_bytes: None
                }
            ]
        );
        assert!(reading.unavailable.is_empty());
    }

    #[test]
    fn unsupported_figures_are_absent_and_failures_are_named() {
        let device = FakeDevice {
            temperature_fails: true,
            ..FakeDevice::default()
        };
        let reading = read_device(&device, 0);
        assert_eq!(reading.power_watts, None);
        assert_eq!(reading.pcie_tx_bytes_per_second, None);
        assert_eq!(reading.nvlink_rx_bytes_total, None);
        assert_eq!(reading.temperature_celsius, None);
        assert_eq!(reading.unavailable.len(), 1);
        assert!(
            reading.unavailable[0].starts_with("temperature:"),
            "{:?}",
            reading.unavailable
        );
        // The rest is still read.
        assert_eq!(reading.utilization_gpu_percent, Some(87));
    }

    #[test]
    fn without_a_driver_the_snapshot_is_empty_with_a_reason() {
        let gpus = Gpus::init();
        if gpus.nvml.is_ok() {
            eprintln!(
                "SKIPPED: this machine has an NVIDIA driver; the no-driver path is not testable here"
            );
            return;
        }
        let snapshot = gpus.snapshot();
        assert!(snapshot.gpus.is_empty());
        let reason = snapshot.unavailable_reason.unwrap();
        assert!(reason.contains("libnvidia-ml"), "{reason}");
    }
}

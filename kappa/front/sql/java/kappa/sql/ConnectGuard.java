package kappa.sql;

import java.util.EnumSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

import org.apache.spark.connect.proto.AddArtifactsRequest;
import org.apache.spark.connect.proto.Command;
import org.apache.spark.connect.proto.ExecutePlanRequest;
import org.sparkproject.connect.grpc.ForwardingServerCallListener;
import org.sparkproject.connect.grpc.Metadata;
import org.sparkproject.connect.grpc.ServerCall;
import org.sparkproject.connect.grpc.ServerCallHandler;
import org.sparkproject.connect.grpc.ServerInterceptor;
import org.sparkproject.connect.grpc.Status;
import org.sparkproject.connect.protobuf.Descriptors;
import org.sparkproject.connect.protobuf.Message;

/**
 * The Spark Connect endpoint's read-only guard (spark.connect.grpc.interceptor.classes): of the commands a client
 * sends it admits SQL (checked again by {@link ReadOnly}), temporary views and resource lookups; it refuses the
 * rest - writes, streaming queries, ML training, pipelines, function and data-source registration, checkpoints,
 * external commands - every upload of artifacts (jars, Python files) and every request that carries code (UDFs,
 * closures, Python data sources: deserializing them would run the client's code), before any of it runs.
 */
public final class ConnectGuard implements ServerInterceptor {

    private static final Set<Command.CommandTypeCase> ADMITTED = EnumSet.of(
            Command.CommandTypeCase.SQL_COMMAND, Command.CommandTypeCase.CREATE_DATAFRAME_VIEW,
            Command.CommandTypeCase.GET_RESOURCES_COMMAND,
            Command.CommandTypeCase.REMOVE_CACHED_REMOTE_RELATION_COMMAND);

    /** Request fields that carry code to run on the server (UDFs of every kind, closures, Python data sources). */
    private static final String[] CODE_FIELDS = {"udf", "udtf", "user_defined", "map_partitions", "group_map",
            "co_group_map", "apply_in_pandas", "transform_with_state", "python_data_source"};

    /** The name of the first field of {@code message} (recursively) that carries code, else null. */
    static String codeField(Message message) {
        for (Map.Entry<Descriptors.FieldDescriptor, Object> field : message.getAllFields().entrySet()) {
            String name = field.getKey().getName();
            for (String code : CODE_FIELDS) {
                if (name.contains(code)) {
                    return name;
                }
            }
            Object value = field.getValue();
            if (value instanceof Message) {
                String found = codeField((Message) value);
                if (found != null) {
                    return found;
                }
            } else if (value instanceof List) {
                for (Object item : (List<?>) value) {
                    if (item instanceof Message) {
                        String found = codeField((Message) item);
                        if (found != null) {
                            return found;
                        }
                    }
                }
            }
        }
        return null;
    }

    static String refusal(Object message) {
        if (message instanceof AddArtifactsRequest) {
            return "kappa sql is read-only: uploading artifacts (jars, Python files, UDF code) is refused";
        }
        if (message instanceof ExecutePlanRequest) {
            ExecutePlanRequest request = (ExecutePlanRequest) message;
            if (request.hasPlan() && request.getPlan().hasCommand()) {
                Command.CommandTypeCase kind = request.getPlan().getCommand().getCommandTypeCase();
                if (!ADMITTED.contains(kind)) {
                    return "kappa sql is read-only: the Spark Connect command " + kind.name().toLowerCase()
                            + " is refused (only queries, SQL and temporary views)";
                }
            }
            String code = codeField(request);
            if (code != null) {
                return "kappa sql is read-only: code sent by the client (" + code + ") is refused";
            }
        }
        return null;
    }

    @Override
    public <ReqT, RespT> ServerCall.Listener<ReqT> interceptCall(ServerCall<ReqT, RespT> call, Metadata headers,
                                                                 ServerCallHandler<ReqT, RespT> next) {
        ServerCall.Listener<ReqT> delegate = next.startCall(call, headers);
        return new ForwardingServerCallListener.SimpleForwardingServerCallListener<ReqT>(delegate) {
            private boolean closed;

            @Override
            public void onMessage(ReqT message) {
                if (closed) {
                    return;
                }
                String why = refusal(message);
                if (why != null) {
                    closed = true;
                    call.close(Status.PERMISSION_DENIED.withDescription(why), new Metadata());
                    return;
                }
                super.onMessage(message);
            }

            @Override
            public void onHalfClose() {
                if (!closed) {
                    super.onHalfClose();
                }
            }
        };
    }
}
